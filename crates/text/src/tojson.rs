//! `tojson` as Hugging Face chat templates expect it: Python's
//! `json.dumps(x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)`
//! (`", "` and `": "` separators, `","` between items when indenting, no HTML escaping).

use std::fmt::Write;

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

struct Style {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

/// The `tojson` filter.
pub(crate) fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(usize::try_from(n).unwrap_or(0))),
            None => match v.as_str() {
                Some(s) => Some(s.to_string()),
                None => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson indent must be an integer or a string",
                    ))
                }
            },
        },
    };
    let separators: Option<Value> = kwargs.get("separators")?;
    let (item_sep, key_sep) = match separators.filter(|v| !v.is_none() && !v.is_undefined()) {
        Some(v) => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] => match (a.as_str(), b.as_str()) {
                    (Some(a), Some(b)) => (a.to_string(), b.to_string()),
                    _ => return Err(bad_separators()),
                },
                _ => return Err(bad_separators()),
            }
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let style = Style {
        indent,
        item_sep,
        key_sep,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_value(&mut out, value, &style, 0)?;
    // Safe for templates: the JSON text is meant to land in the prompt verbatim.
    Ok(Value::from_safe_string(out))
}

fn bad_separators() -> Error {
    Error::new(
        ErrorKind::InvalidOperation,
        "tojson separators must be a pair of strings",
    )
}

fn newline(out: &mut String, style: &Style, depth: usize) {
    if let Some(ind) = &style.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(ind);
        }
    }
}

fn write_value(out: &mut String, v: &Value, style: &Style, depth: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                let _ = write!(out, "{v}");
            } else {
                match f64::try_from(v.clone()) {
                    Ok(f) => write_float(out, f),
                    Err(_) => {
                        let _ = write!(out, "{v}");
                    }
                }
            }
        }
        ValueKind::String => write_str(out, v.as_str().unwrap_or_default(), style.ensure_ascii),
        ValueKind::Bytes => write_str(
            out,
            &String::from_utf8_lossy(v.as_bytes().unwrap_or_default()),
            style.ensure_ascii,
        ),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            write_container(out, style, depth, '[', ']', &items, |out, item, d| {
                write_value(out, item, style, d)
            })?;
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for key in v.try_iter()? {
                let item = v.get_item(&key)?;
                let key = match key.as_str() {
                    Some(s) => s.to_string(),
                    None => key_text(&key),
                };
                entries.push((key, item));
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(
                out,
                style,
                depth,
                '{',
                '}',
                &entries,
                |out, (k, item), d| {
                    write_str(out, k, style.ensure_ascii);
                    out.push_str(&style.key_sep);
                    write_value(out, item, style, d)
                },
            )?;
        }
        // Functions, plain objects and invalid values have no JSON form.
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson cannot serialize a {}", v.kind()),
            ))
        }
    }
    Ok(())
}

/// Python turns non-string keys into their JSON text (`1` -> "1", `True` -> "true").
fn key_text(key: &Value) -> String {
    match key.kind() {
        ValueKind::None | ValueKind::Undefined => "null".to_string(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_string(),
        _ => key.to_string(),
    }
}

fn write_container<T>(
    out: &mut String,
    style: &Style,
    depth: usize,
    open: char,
    close: char,
    items: &[T],
    mut each: impl FnMut(&mut String, &T, usize) -> Result<(), Error>,
) -> Result<(), Error> {
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return Ok(());
    }
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(&style.item_sep);
        }
        newline(out, style, depth + 1);
        each(out, item, depth + 1)?;
    }
    newline(out, style, depth);
    out.push(close);
    Ok(())
}

/// Python's float repr: shortest round-trip digits, exponent form outside [1e-4, 1e16).
fn write_float(out: &mut String, f: f64) {
    if f.is_nan() {
        out.push_str("NaN");
    } else if f.is_infinite() {
        out.push_str(if f > 0.0 { "Infinity" } else { "-Infinity" });
    } else {
        let sci = format!("{f:e}");
        let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
        let exp: i32 = exp.parse().unwrap_or(0);
        if f != 0.0 && !(-4..16).contains(&exp) {
            let sign = if exp < 0 { '-' } else { '+' };
            let _ = write!(out, "{mantissa}e{sign}{:02}", exp.abs());
        } else {
            let plain = format!("{f}");
            out.push_str(&plain);
            if !plain.contains('.') {
                out.push_str(".0");
            }
        }
    }
}

fn write_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dumps(v: serde_json::Value, indent: Option<i64>) -> String {
        let kwargs = match indent {
            Some(n) => Kwargs::from_iter([("indent", Value::from(n))]),
            None => Kwargs::from_iter(std::iter::empty::<(&str, Value)>()),
        };
        tojson(&Value::from(minijinja::value::Serde(&v)), kwargs)
            .map(|v| v.to_string())
            .unwrap_or_else(|e| panic!("tojson failed: {e}"))
    }

    #[test]
    fn python_separators_and_escapes() {
        let v = serde_json::json!({"a": 1, "b": [true, null, 1.5, "x\"<é>\n"], "c": {}});
        assert_eq!(
            dumps(v, None),
            r#"{"a": 1, "b": [true, null, 1.5, "x\"<é>\n"], "c": {}}"#
        );
    }

    #[test]
    fn indent_uses_python_layout() {
        let v = serde_json::json!({"a": [1, 2], "b": []});
        assert_eq!(
            dumps(v, Some(2)),
            "{\n  \"a\": [\n    1,\n    2\n  ],\n  \"b\": []\n}"
        );
    }

    #[test]
    fn floats_follow_python_repr() {
        let mut s = String::new();
        for f in [1.0, 0.5, 1e16, 1.5e-7, 123.25, -0.0001] {
            write_float(&mut s, f);
            s.push(' ');
        }
        assert_eq!(s, "1.0 0.5 1e+16 1.5e-07 123.25 -0.0001 ");
    }
}
