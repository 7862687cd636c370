//! Inference names of trained models: `<entity>/<project>/<name>` (the latest checkpoint),
//! `…:step<N>`, `…:latest`, optionally behind an artifact-URI prefix `<scheme>://` or
//! `<scheme>:///`, which is ignored.

/// Which checkpoint of a model a name asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepSelector {
    Latest,
    Step(i64),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainedName<'a> {
    pub entity: &'a str,
    pub project: &'a str,
    pub name: &'a str,
    pub step: StepSelector,
}

/// Strips `<scheme>://` or `<scheme>:///` (scheme: a letter, then letters, digits, `+ - .`).
fn strip_uri_scheme(s: &str) -> &str {
    let Some((scheme, rest)) = s.split_once("://") else {
        return s;
    };
    let mut chars = scheme.chars();
    let valid = chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    if valid {
        rest.strip_prefix('/').unwrap_or(rest)
    } else {
        s
    }
}

/// Parses a trained model's name; `None` when `s` has not that shape (then it can only be a base
/// model's name).
pub fn parse(s: &str) -> Option<TrainedName<'_>> {
    let s = strip_uri_scheme(s);
    let (path, step) = match s.rsplit_once(':') {
        None => (s, StepSelector::Latest),
        Some((path, "latest")) => (path, StepSelector::Latest),
        Some((path, suffix)) => {
            let digits = suffix.strip_prefix("step")?;
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            (path, StepSelector::Step(digits.parse().ok()?))
        }
    };
    let mut parts = path.split('/');
    let (entity, project, name) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || [entity, project, name].iter().any(|p| p.is_empty()) {
        return None;
    }
    Some(TrainedName {
        entity,
        project,
        name,
        step,
    })
}

/// The name of one checkpoint as `GET /v1/models` lists it.
pub fn checkpoint_name(entity: &str, project: &str, name: &str, step: i64) -> String {
    format!("{entity}/{project}/{name}:step{step}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(entity: &'static str, step: StepSelector) -> Option<TrainedName<'static>> {
        Some(TrainedName {
            entity,
            project: "p",
            name: "n",
            step,
        })
    }

    #[test]
    fn forms() {
        use StepSelector::*;
        assert_eq!(parse("t/p/n"), name("t", Latest));
        assert_eq!(parse("t/p/n:latest"), name("t", Latest));
        assert_eq!(parse("t/p/n:step0"), name("t", Step(0)));
        assert_eq!(parse("t/p/n:step12"), name("t", Step(12)));
        assert_eq!(parse("wandb-artifact:///t/p/n:step3"), name("t", Step(3)));
        assert_eq!(parse("art://t/p/n"), name("t", Latest));
        assert_eq!(parse("s3+x.y-z:///t/p/n:latest"), name("t", Latest));
    }

    #[test]
    fn not_trained_names() {
        for s in [
            "gemma-3-270m",
            "t/p",
            "t/p/n/x",
            "t//n",
            "t/p/n:",
            "t/p/n:step",
            "t/p/n:step-1",
            "t/p/n:step1x",
            "t/p/n:v3",
            "t/p/n:step99999999999999999999",
            "1bad://t/p/n",
        ] {
            assert_eq!(parse(s), None, "{s}");
        }
    }

    #[test]
    fn listed_names_parse_back() {
        let n = checkpoint_name("acme", "agents", "m.v1", 4);
        assert_eq!(
            parse(&n),
            Some(TrainedName {
                entity: "acme",
                project: "agents",
                name: "m.v1",
                step: StepSelector::Step(4)
            })
        );
    }
}
