//! Structured outputs with llguidance: a request's constraint (JSON schema, regex, choice, Lark
//! grammar, structural tags) is compiled once against the model's vocabulary into a `Grammar`;
//! each choice then runs its own `GrammarMatcher`, which yields the allowed-token mask for the
//! next token and consumes the sampled one. The vocabulary is given to llguidance through our
//! own tokenizer (`Tokenizer::token_bytes`), not an HF-tokenizer adapter.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};
use serde_json::{Map, Value};
use temper_text::tool_calls::{self, FunctionSchema, ToolCallFormat};
use temper_text::{TokenKind, Tokenizer};

/// What a request's output must match (validated shape; compiled by `GrammarCompiler`).
#[derive(Clone, Debug, PartialEq)]
pub enum OutputConstraint {
    /// JSON matching a JSON schema (`response_format` json_schema / json_object,
    /// `structured_outputs.json` / `json_object`; json_object is `{"type": "object"}`).
    Json { schema: Value, options: JsonOptions },
    /// Text matching a regular expression (Rust `regex` syntax), as a whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark grammar (llguidance's dialect).
    Grammar(String),
    /// Free text in which every trigger starts one of the structures: `begin`, JSON matching
    /// `schema`, `end`.
    StructuralTag {
        triggers: Vec<String>,
        structures: Vec<TagStructure>,
        options: JsonOptions,
    },
    /// Tool calls in the model's `format` and nothing else: one or more calls (one unless
    /// `parallel`), each of one of `functions` with arguments matching its schema.
    ToolCalls {
        format: ToolCallFormat,
        functions: Vec<FunctionSchema>,
        parallel: bool,
    },
}

/// Options of the JSON grammar.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JsonOptions {
    /// No whitespace between JSON tokens (compact separators). Otherwise whitespace between
    /// tokens matches `FLEXIBLE_WHITESPACE`.
    pub disable_any_whitespace: bool,
    /// Objects with `properties` and no `additionalProperties` get `additionalProperties: false`.
    pub disable_additional_properties: bool,
    /// The regex whitespace between JSON tokens must match (wins over the two above).
    pub whitespace_pattern: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct TagStructure {
    pub begin: String,
    pub schema: Value,
    pub end: String,
}

#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum GrammarError {
    #[error("invalid structured output: {0}")]
    Invalid(String),
    #[error("structured output matcher failed: {0}")]
    Matcher(String),
}

/// Compiles constraints for one model's vocabulary. Building it walks the whole vocabulary once
/// (a trie of token bytes plus llguidance's lexer slices), so one is made per model and shared.
pub struct GrammarCompiler {
    factory: ParserFactory,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field(
                "vocab_size",
                &self.factory.tok_env().tok_trie().vocab_size(),
            )
            .finish()
    }
}

/// llguidance's view of our tokenizer.
struct TokenizerView {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for TokenizerView {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie
            .tokenize_with_greedy_fallback(s, |text| self.tokenizer.encode(text, false))
    }
}

impl GrammarCompiler {
    /// `end_tokens`: the tokens that end generation (EOS, end of turn); the grammar allows them
    /// exactly where it accepts.
    pub fn new(tokenizer: Arc<Tokenizer>, end_tokens: &[u32]) -> Result<Self, GrammarError> {
        let vocab = tokenizer.vocab_size();
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| match tokenizer.kind(id) {
                // llguidance marks special tokens with a leading 0xFF: plain text never
                // matches them.
                Some(TokenKind::Control | TokenKind::Unknown | TokenKind::Unused) => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tokenizer.piece(id).unwrap_or_default().as_bytes());
                    w
                }
                _ => tokenizer
                    .token_bytes(id)
                    .map(|b| b.into_owned())
                    .unwrap_or_default(),
            })
            .collect();
        let Some(&eos) = end_tokens.first() else {
            return Err(GrammarError::Invalid(
                "the model has no end-of-sequence token".into(),
            ));
        };
        let mut info = TokRxInfo::new(vocab as u32, eos);
        info.tok_bos = tokenizer.bos_id();
        let trie = TokTrie::from(&info, &words).with_eos_tokens(end_tokens);
        let env: TokEnv = Arc::new(TokenizerView { trie, tokenizer });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Invalid(format!("{e:#}")))?;
        // Errors come back to the caller; nothing should go to stderr.
        factory.quiet();
        Ok(GrammarCompiler { factory })
    }

    /// Compiles `constraint` and computes its first mask. Errors (a bad schema, regex or
    /// grammar) are the request's fault.
    pub fn compile(&self, constraint: &OutputConstraint) -> Result<Grammar, GrammarError> {
        let grammar = top_level_grammar(constraint)?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| GrammarError::Invalid(format!("{e:#}")))?;
        let mut matcher = GrammarMatcher(Matcher::new(Ok(parser)));
        let first_mask = matcher
            .compute_mask()
            .map_err(|e| GrammarError::Invalid(e.to_string()))?;
        Ok(Grammar {
            matcher,
            first_mask: Arc::new(first_mask),
        })
    }
}

/// A compiled constraint in its start state, with the mask of the first token. Cloning it is
/// cheap: each choice clones its own matcher from it.
#[derive(Clone)]
pub struct Grammar {
    matcher: GrammarMatcher,
    first_mask: Arc<TokenMask>,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar")
            .field("first_mask_allowed", &self.first_mask.allowed_count())
            .finish()
    }
}

impl Grammar {
    /// A fresh matcher at the start of the output.
    pub fn matcher(&self) -> GrammarMatcher {
        self.matcher.clone()
    }

    pub fn first_mask(&self) -> &TokenMask {
        &self.first_mask
    }
}

/// One choice's position in the grammar.
#[derive(Clone)]
pub struct GrammarMatcher(Matcher);

impl GrammarMatcher {
    /// The tokens allowed next (end tokens only where the grammar accepts). Takes from
    /// microseconds to milliseconds: run it off the scheduler thread.
    pub fn compute_mask(&mut self) -> Result<TokenMask, GrammarError> {
        self.0
            .compute_mask()
            .map(TokenMask)
            .map_err(|e| GrammarError::Matcher(format!("{e:#}")))
    }

    /// Advances past a sampled token (fast).
    pub fn consume(&mut self, token: u32) -> Result<(), GrammarError> {
        self.0
            .consume_token(token)
            .map_err(|e| GrammarError::Matcher(format!("{e:#}")))
    }

    /// The grammar is complete and cannot be extended: the choice is done.
    pub fn is_stopped(&self) -> bool {
        self.0.is_stopped()
    }

    pub fn is_accepting(&mut self) -> bool {
        self.0.is_accepting().unwrap_or(false)
    }
}

/// A set of allowed token ids, one bit per token of the vocabulary.
#[derive(Clone, Debug)]
pub struct TokenMask(SimpleVob);

impl TokenMask {
    pub fn is_allowed(&self, token: u32) -> bool {
        (token as usize) < self.0.len() && self.0.is_allowed(token)
    }

    pub fn allowed_count(&self) -> usize {
        self.0.num_set()
    }

    /// 32 tokens per word, token `32 * w + b` at bit `b` of word `w`.
    pub(crate) fn words(&self) -> &[u32] {
        self.0.as_slice()
    }
}

/// Writes `raw` into `out` with every token outside `mask` at -inf (tokens past the mask's
/// vocabulary included). Whole 32-token words are copied or filled at once.
pub(crate) fn masked_copy(raw: &[f32], mask: &TokenMask, out: &mut Vec<f32>) {
    out.clear();
    out.resize(raw.len(), f32::NEG_INFINITY);
    for ((dst, src), &word) in out.chunks_mut(32).zip(raw.chunks(32)).zip(mask.words()) {
        match word {
            0 => {}
            u32::MAX => dst.copy_from_slice(src),
            mut w => {
                while w != 0 {
                    let b = w.trailing_zeros() as usize;
                    if let (Some(d), Some(&s)) = (dst.get_mut(b), src.get(b)) {
                        *d = s;
                    }
                    w &= w - 1;
                }
            }
        }
    }
}

/// Whitespace allowed between JSON tokens by default: one space or tab, or one line break
/// with up to 32 spaces or tabs of indentation. That covers compact, one-space and
/// pretty-printed JSON; unbounded whitespace (llguidance's own default) lets a small model at
/// temperature 1 emit blank lines until it runs out of tokens, and the output never parses.
pub const FLEXIBLE_WHITESPACE: &str = r"[ \t]|\r?\n[ \t]{0,32}";

fn top_level_grammar(constraint: &OutputConstraint) -> Result<TopLevelGrammar, GrammarError> {
    Ok(match constraint {
        OutputConstraint::Json { schema, options } => {
            TopLevelGrammar::from_json_schema(json_schema(schema, options)?)
        }
        OutputConstraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
        OutputConstraint::Choice(choices) => {
            if choices.is_empty() {
                return Err(GrammarError::Invalid("`choice` must not be empty".into()));
            }
            let alternatives: Vec<String> = choices.iter().map(|c| lark_literal(c)).collect();
            TopLevelGrammar::from_lark(format!("start: {}\n", alternatives.join(" | ")))
        }
        OutputConstraint::Grammar(lark) => TopLevelGrammar::from_lark(lark.clone()),
        OutputConstraint::StructuralTag {
            triggers,
            structures,
            options,
        } => TopLevelGrammar::from_lark(structural_tag_lark(triggers, structures, options)?),
        OutputConstraint::ToolCalls {
            format,
            functions,
            parallel,
        } => {
            if functions.is_empty() {
                return Err(GrammarError::Invalid("no functions to call".into()));
            }
            let functions = functions
                .iter()
                .map(|f| {
                    Ok(FunctionSchema {
                        name: f.name.clone(),
                        parameters: json_schema(&f.parameters, &JsonOptions::default())?,
                    })
                })
                .collect::<Result<Vec<_>, GrammarError>>()?;
            TopLevelGrammar::from_lark(tool_calls::grammar(*format, &functions, *parallel))
        }
    })
}

/// A Lark string literal: llguidance reads them as JSON strings.
fn lark_literal(s: &str) -> String {
    Value::String(s.to_owned()).to_string()
}

/// The schema with the request's JSON options attached (llguidance reads them from
/// `x-guidance`; a schema's own `x-guidance` wins, as in vLLM).
fn json_schema(schema: &Value, options: &JsonOptions) -> Result<Value, GrammarError> {
    let mut schema = match schema {
        Value::Bool(true) => Value::Object(Map::new()),
        Value::Bool(false) => {
            return Err(GrammarError::Invalid(
                "the schema `false` matches nothing".into(),
            ))
        }
        Value::Object(_) => schema.clone(),
        _ => {
            return Err(GrammarError::Invalid(
                "a JSON schema must be an object or a boolean".into(),
            ))
        }
    };
    if options.disable_additional_properties {
        forbid_additional_properties(&mut schema);
    }
    if let Value::Object(map) = &mut schema {
        if !map.contains_key("x-guidance") {
            let whitespace_pattern =
                match (&options.whitespace_pattern, options.disable_any_whitespace) {
                    (Some(p), _) => Some(p.clone()),
                    (None, false) => Some(FLEXIBLE_WHITESPACE.to_owned()),
                    (None, true) => None,
                };
            let compile = JsonCompileOptions {
                whitespace_flexible: !options.disable_any_whitespace,
                whitespace_pattern,
                ..JsonCompileOptions::default()
            };
            let value =
                serde_json::to_value(&compile).map_err(|e| GrammarError::Invalid(e.to_string()))?;
            map.insert("x-guidance".into(), value);
        }
    }
    Ok(schema)
}

/// vLLM's `disable_additional_properties`: every object schema listing `properties` (or
/// `patternProperties`) and not saying otherwise gets `additionalProperties: false`.
fn forbid_additional_properties(schema: &mut Value) {
    const SCHEMA_MAPS: [&str; 6] = [
        "properties",
        "patternProperties",
        "$defs",
        "definitions",
        "dependentSchemas",
        "dependencies",
    ];
    const SUBSCHEMAS: [&str; 16] = [
        "additionalProperties",
        "unevaluatedProperties",
        "propertyNames",
        "contains",
        "additionalItems",
        "unevaluatedItems",
        "not",
        "if",
        "then",
        "else",
        "contentSchema",
        "items",
        "prefixItems",
        "allOf",
        "anyOf",
        "oneOf",
    ];
    match schema {
        Value::Object(map) => {
            for key in SCHEMA_MAPS {
                if let Some(Value::Object(subs)) = map.get_mut(key) {
                    subs.values_mut().for_each(forbid_additional_properties);
                }
            }
            for key in SUBSCHEMAS {
                if let Some(sub @ (Value::Object(_) | Value::Array(_))) = map.get_mut(key) {
                    forbid_additional_properties(sub);
                }
            }
            let has_properties = ["properties", "patternProperties"]
                .iter()
                .any(|k| matches!(map.get(*k), Some(Value::Object(_))));
            if has_properties && !map.contains_key("additionalProperties") {
                map.insert("additionalProperties".into(), Value::Bool(false));
            }
        }
        Value::Array(items) => items.iter_mut().for_each(forbid_additional_properties),
        _ => {}
    }
}

/// Free text that never contains a trigger, with structures in between: each is its `begin`,
/// JSON matching its schema, and its `end`. Every structure's `begin` must start with a
/// trigger (vLLM's rule), so text cannot sneak a trigger past the grammar.
fn structural_tag_lark(
    triggers: &[String],
    structures: &[TagStructure],
    options: &JsonOptions,
) -> Result<String, GrammarError> {
    if structures.is_empty() {
        return Err(GrammarError::Invalid(
            "no structures in the structural tag".into(),
        ));
    }
    if triggers.is_empty() || triggers.iter().any(String::is_empty) {
        return Err(GrammarError::Invalid(
            "structural tag triggers must be non-empty strings".into(),
        ));
    }
    let mut rules = Vec::new();
    for (i, s) in structures.iter().enumerate() {
        if !triggers.iter().any(|t| s.begin.starts_with(t.as_str())) {
            return Err(GrammarError::Invalid(format!(
                "structure begin {:?} does not start with any trigger of {triggers:?}",
                s.begin
            )));
        }
        let schema = json_schema(&s.schema, options)?;
        rules.push(format!(
            "tag_{i}: {} %json {} {}",
            lark_literal(&s.begin),
            schema,
            lark_literal(&s.end)
        ));
    }
    let tags: Vec<String> = (0..structures.len()).map(|i| format!("tag_{i}")).collect();
    let trigger_rx: Vec<String> = triggers.iter().map(|t| regex_escape(t)).collect();
    Ok(format!(
        "start: (TEXT tag)* TEXT\ntag: {}\n{}\nTEXT: /(?s:.*)/ & ~/(?s:.*({}).*)/\n",
        tags.join(" | "),
        rules.join("\n"),
        trigger_rx.join("|")
    ))
}

/// Escapes regex metacharacters (and the Lark regex delimiter `/`).
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~/".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mask(bits: &[u32], len: usize) -> TokenMask {
        let mut v = SimpleVob::alloc(len);
        for &b in bits {
            v.allow_token(b);
        }
        TokenMask(v)
    }

    #[test]
    fn masked_copy_keeps_exactly_the_allowed_tokens() {
        let raw: Vec<f32> = (0..100).map(|i| i as f32).collect();
        let allowed = [0u32, 5, 31, 32, 33, 64, 99];
        let m = mask(&allowed, 100);
        let mut out = Vec::new();
        masked_copy(&raw, &m, &mut out);
        for i in 0..100u32 {
            let want = if allowed.contains(&i) {
                i as f32
            } else {
                f32::NEG_INFINITY
            };
            assert_eq!(out[i as usize], want, "token {i}");
        }
        // A full word is copied whole; a row longer than the mask is masked past its end.
        let m = TokenMask(SimpleVob::alloc_ones(32));
        masked_copy(&raw[..40], &m, &mut out);
        assert_eq!(&out[..32], &raw[..32]);
        assert!(out[32..].iter().all(|l| *l == f32::NEG_INFINITY));
    }

    #[test]
    fn additional_properties_are_forbidden_where_unspecified() {
        let mut s = serde_json::json!({
            "type": "object",
            "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}},
            "$defs": {"d": {"properties": {}, "additionalProperties": true}},
            "anyOf": [{"properties": {"c": {}}}],
        });
        forbid_additional_properties(&mut s);
        assert_eq!(s["additionalProperties"], false);
        assert_eq!(s["properties"]["a"]["additionalProperties"], false);
        assert_eq!(s["$defs"]["d"]["additionalProperties"], true);
        assert_eq!(s["anyOf"][0]["additionalProperties"], false);
    }

    #[test]
    fn json_options_go_to_x_guidance_unless_the_schema_has_its_own() {
        let opts = JsonOptions {
            disable_any_whitespace: true,
            whitespace_pattern: Some(" ?".into()),
            ..JsonOptions::default()
        };
        let s = json_schema(&serde_json::json!({"type": "integer"}), &opts).unwrap();
        assert_eq!(s["x-guidance"]["whitespace_flexible"], false);
        assert_eq!(s["x-guidance"]["whitespace_pattern"], " ?");
        let flexible = json_schema(&serde_json::json!({}), &JsonOptions::default()).unwrap();
        assert_eq!(
            flexible["x-guidance"]["whitespace_pattern"],
            FLEXIBLE_WHITESPACE
        );
        let own = serde_json::json!({"x-guidance": {"lenient": true}});
        assert_eq!(json_schema(&own, &opts).unwrap(), own);
        assert!(json_schema(&serde_json::json!(false), &opts).is_err());
        assert!(json_schema(&serde_json::json!(3), &opts).is_err());
    }
}
