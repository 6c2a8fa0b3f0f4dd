//! A model's chat template, found and rendered as vLLM renders it: through Hugging Face
//! `transformers`' Jinja environment, whose settings and helpers change the text a template
//! gives, and so the tokens a worker caches.
//!
//! What that environment has, and this one reproduces:
//! - `trim_blocks` and `lstrip_blocks`: a block tag's own line leaves no newline or indent;
//! - Python's string and dict methods (`.strip()`, `.split()`, `.startswith()`, `.items()`, ...),
//!   which many templates call (minijinja-contrib's `pycompat`);
//! - `{% break %}` and `{% continue %}`;
//! - `tojson` as Python's `json.dumps` writes it (`", "` and `": "` between items, no HTML
//!   escapes, `indent`, `separators` and `sort_keys`), not Jinja's HTML-safe one;
//! - `raise_exception(message)` and `strftime_now(format)` (the date a Llama 3.2 system header
//!   carries, here in the gateway's time zone);
//! - maps in the order they were written, as Python's dicts keep them;
//! - `True`, `False` and `None` printed as Python prints them.
//!
//! Where the template comes from, as `transformers` loads it: a `chat_template.jinja` beside
//! `tokenizer_config.json` before the config's own `chat_template`, which may be a string or a
//! list of named templates (the one named `default` is used).

use std::path::Path;

use minijinja::{value::ValueKind, Environment, Error, ErrorKind, Value as JinjaValue};
use serde_json::Value;

use super::conversation::{variables, ChatOptions};
use super::TokenizeError;

/// The file recent `transformers` releases write a model's chat template to, and read first.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// A chat template ready to render, with the special tokens it may name.
pub(super) struct ChatTemplate {
    env: Environment<'static>,
    /// Whether the template loops over a message's content, so that vLLM hands it the parts
    /// (its "openai" content format) rather than one string.
    openai_content: bool,
    /// Whether the template names the `developer` role (vLLM turns such messages into system
    /// messages for one that does not).
    knows_developer: bool,
    /// `bos_token`, `eos_token`, `unk_token`, `pad_token`: what `tokenizer_config.json` says,
    /// as `transformers` hands them to every template (made template values once, here).
    tokens: Vec<(&'static str, JinjaValue)>,
    /// The server's `--default-chat-template-kwargs`, under each request's own.
    pub(super) defaults: serde_json::Map<String, Value>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// The template `config` (a parsed `tokenizer_config.json`, read from `dir`) leads to: the
    /// file at `explicit` when given (vLLM's `--chat-template`), else `dir`'s
    /// `chat_template.jinja`, else the config's own; `None` when there is none.
    pub(super) fn find(
        config: &Value,
        dir: Option<&Path>,
        explicit: Option<&Path>,
    ) -> Result<Option<Self>, TokenizeError> {
        let read = |path: &Path| {
            std::fs::read_to_string(path).map_err(|e| TokenizeError::Load {
                path: path.display().to_string(),
                detail: e.to_string(),
            })
        };
        let beside = dir.map(|d| d.join(CHAT_TEMPLATE_FILE));
        let source = match (explicit, beside) {
            (Some(path), _) => Some(read(path)?),
            (None, Some(file)) if file.is_file() => Some(read(&file)?),
            _ => from_config(config.get("chat_template"))?,
        };
        let Some(source) = source else {
            return Ok(None);
        };
        let tokens = ["bos_token", "eos_token", "unk_token", "pad_token"]
            .into_iter()
            .map(|name| (name, JinjaValue::from(token_text(config.get(name)))))
            .collect();
        Ok(Some(Self {
            openai_content: loops_over_content(&source),
            knows_developer: source.contains("\"developer\"") || source.contains("'developer'"),
            env: environment(source)?,
            tokens,
            defaults: serde_json::Map::new(),
        }))
    }

    /// The template's text for a chat request's `messages` and `options`, as vLLM renders it.
    pub(super) fn render(
        &self,
        messages: &Value,
        options: &ChatOptions,
    ) -> Result<String, TokenizeError> {
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| TokenizeError::Template(e.to_string()))?;
        let vars = variables(
            messages,
            options,
            &self.defaults,
            self.openai_content,
            self.knows_developer,
        )?;
        let context = self
            .tokens
            .iter()
            .map(|(name, value)| (JinjaValue::from(*name), value.clone()))
            .chain(vars.into_iter().map(|(k, v)| (JinjaValue::from(k), v)));
        template
            .render(JinjaValue::from_iter(context))
            .map_err(|e| TokenizeError::Template(e.to_string()))
    }
}

/// Whether some `{% for ... in ... %}` of `source` iterates over a message's `content` (its
/// `['content']`, `["content"]` or `.content`): vLLM's test for the "openai" content format,
/// which it makes on the template's syntax tree, made here on the tags' text.
fn loops_over_content(source: &str) -> bool {
    source.split("{%").skip(1).any(|tag| {
        let tag = tag.split("%}").next().unwrap_or_default();
        let tag = tag.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        let Some(rest) = tag.strip_prefix("for ") else {
            return false;
        };
        let Some((_, iterable)) = rest.split_once(" in ") else {
            return false;
        };
        let iterable = iterable.split(" if ").next().unwrap_or_default();
        iterable.contains("['content']")
            || iterable.contains("[\"content\"]")
            || iterable.match_indices(".content").any(|(at, m)| {
                !iterable[at + m.len()..].starts_with(|c: char| c.is_alphanumeric() || c == '_')
            })
    })
}

/// The config's `chat_template`: a string, or a list of `{name, template}` whose `default` is
/// the one used without tools.
fn from_config(v: Option<&Value>) -> Result<Option<String>, TokenizeError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(named)) => named
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template")?.as_str())
            .map(|s| Some(s.to_owned()))
            .ok_or_else(|| {
                TokenizeError::Template("a list of chat templates without a `default` one".into())
            }),
        Some(_) => Err(TokenizeError::Template(
            "`chat_template` is neither a string nor a list of named templates".into(),
        )),
    }
}

/// A special token as `tokenizer_config.json` writes it: a string or `{"content": ...}`.
fn token_text(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    }
}

/// An environment set up as `transformers`' is, holding `source` as the template `chat`.
fn environment(source: String) -> Result<Environment<'static>, TokenizeError> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    // Python prints its booleans and `None` capitalised.
    env.set_formatter(|out, state, value| match value.kind() {
        ValueKind::Bool => Ok(out.write_str(if value.is_true() { "True" } else { "False" })?),
        ValueKind::None => Ok(out.write_str("None")?),
        _ => minijinja::escape_formatter(out, state, value),
    });
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson);
    env.add_function("raise_exception", |message: String| -> Result<(), Error> {
        Err(Error::new(ErrorKind::InvalidOperation, message))
    });
    env.add_function("strftime_now", |format: String| -> Result<String, Error> {
        let now = jiff::Zoned::now();
        jiff::fmt::strtime::format(format.as_str(), &now)
            .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))
    });
    env.add_template_owned("chat", generation_blocks_as_ifs(&source))
        .map_err(|e| TokenizeError::Template(e.to_string()))?;
    Ok(env)
}

/// `source` with `transformers`' `{% generation %}` ... `{% endgeneration %}` blocks (which mark
/// an assistant's tokens for training masks and render their body unchanged) written as
/// `{% if true %}` ... `{% endif %}`, which minijinja knows and which render the same, whitespace
/// control included.
fn generation_blocks_as_ifs(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        let (before, tag) = rest.split_at(at);
        out.push_str(before);
        let Some(end) = tag.find("%}") else {
            rest = tag;
            break;
        };
        let inner = &tag[2..end];
        let trimmed = inner.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        let swapped = match trimmed {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match swapped {
            Some(with) => {
                out.push_str("{%");
                out.push_str(&inner.replacen(trimmed, with, 1));
                out.push_str("%}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// `tojson(value, ensure_ascii=false, indent=none, separators=none, sort_keys=false)` as
/// `transformers` defines it: Python's `json.dumps` with those arguments.
fn tojson(value: JinjaValue, kwargs: minijinja::value::Kwargs) -> Result<String, Error> {
    let indent: Option<JinjaValue> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(s) => s.to_owned(),
            None => " ".repeat(
                i64::try_from(v.clone())
                    .ok()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| {
                        Error::new(ErrorKind::InvalidOperation, format!("indent: {v}"))
                    })?,
            ),
        }),
    };
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "separators are (item separator, key separator)",
            ))
        }
        // Python's defaults: no space before a newline when indenting.
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let mut json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    if sort_keys == Some(true) {
        sort(&mut json);
    }
    let mut out = Vec::new();
    let formatter = PyJson {
        indent,
        item,
        key,
        ascii: ensure_ascii == Some(true),
        level: 0,
        has_value: false,
    };
    let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
    serde::Serialize::serialize(&json, &mut ser)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    String::from_utf8(out).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))
}

/// Every map in `v` with its keys sorted, as `sort_keys=True` writes them.
fn sort(v: &mut Value) {
    match v {
        Value::Object(map) => {
            map.sort_keys();
            map.values_mut().for_each(sort);
        }
        Value::Array(items) => items.iter_mut().for_each(sort),
        _ => {}
    }
}

/// serde_json writing as Python's `json.dumps` does: its separators, its indenting (a newline
/// and the indent per level, nothing inside an empty list or map), and with `ensure_ascii`
/// every non-ASCII character as `\uXXXX` (surrogate pairs beyond the BMP).
struct PyJson {
    indent: Option<String>,
    item: String,
    key: String,
    ascii: bool,
    level: usize,
    /// Whether the list or map being written has a value yet (its close then goes on a line
    /// of its own).
    has_value: bool,
}

impl PyJson {
    fn newline<W: ?Sized + std::io::Write>(&self, w: &mut W) -> std::io::Result<()> {
        if let Some(indent) = &self.indent {
            w.write_all(b"\n")?;
            for _ in 0..self.level {
                w.write_all(indent.as_bytes())?;
            }
        }
        Ok(())
    }

    fn open<W: ?Sized + std::io::Write>(&mut self, w: &mut W, b: &[u8]) -> std::io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(b)
    }

    fn close<W: ?Sized + std::io::Write>(&mut self, w: &mut W, b: &[u8]) -> std::io::Result<()> {
        self.level -= 1;
        if self.has_value {
            self.newline(w)?;
        }
        w.write_all(b)
    }

    /// Before a list's item or a map's key: the separator after the one before, and the indent.
    fn next<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if !first {
            w.write_all(self.item.as_bytes())?;
        }
        self.newline(w)
    }
}

impl serde_json::ser::Formatter for PyJson {
    fn begin_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"[")
    }

    fn end_array<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"]")
    }

    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.next(w, first)
    }

    fn end_array_value<W: ?Sized + std::io::Write>(&mut self, _: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn begin_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.open(w, b"{")
    }

    fn end_object<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        self.close(w, b"}")
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.next(w, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(self.key.as_bytes())
    }

    fn end_object_value<W: ?Sized + std::io::Write>(&mut self, _: &mut W) -> std::io::Result<()> {
        self.has_value = true;
        Ok(())
    }

    fn write_string_fragment<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        fragment: &str,
    ) -> std::io::Result<()> {
        if !self.ascii {
            return w.write_all(fragment.as_bytes());
        }
        for c in fragment.chars() {
            if c.is_ascii() {
                w.write_all(&[c as u8])?;
            } else {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    write!(w, "\\u{unit:04x}")?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `template` rendered for `messages`, with `kwargs` as the request's
    /// `chat_template_kwargs` (the template's other variables).
    fn render_with(template: &str, messages: Value, kwargs: Value) -> String {
        let config = json!({"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"});
        let options = ChatOptions {
            chat_template_kwargs: Some(kwargs),
            ..ChatOptions::default()
        };
        ChatTemplate::find(&config, None, None)
            .unwrap()
            .unwrap()
            .render(&messages, &options)
            .unwrap_or_else(|e| format!("ERROR {e}"))
    }

    fn render(template: &str, messages: Value) -> String {
        render_with(template, messages, json!({}))
    }

    // The expected texts are what `transformers` 5.19's `render_jinja_template` (the renderer
    // vLLM 0.32 calls) gave for the same template and messages.

    #[test]
    fn block_tags_leave_no_line_or_indent_of_their_own() {
        let t = "{% for m in messages %}\n  {{ m.content }}\n{% endfor %}\n\
                 {% if add_generation_prompt %}\n  GO\n{% endif %}";
        let m = json!([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]);
        assert_eq!(render(t, m), "  a\n  b\n  GO\n");
    }

    #[test]
    fn python_methods_and_values_print_as_in_python() {
        let t = "{%- for m in messages %}\
                 {{ m.content.split('</think>')[-1].lstrip('\\n').strip() | upper }}|\
                 {{ m.content.startswith('x') }}|{{ m.role.replace('u','U') }}|{{ nothing }}\
                 {% endfor %}";
        let m = json!([{"role": "user", "content": "x</think>\n  done  "}]);
        assert_eq!(
            render_with(t, m, json!({"nothing": null})),
            "DONE|True|User|None"
        );
    }

    #[test]
    fn tojson_writes_as_pythons_json_dumps() {
        let t = "{{ meta | tojson }}\n\
                 {{ meta | tojson(indent=2) }}\n\
                 {{ meta | tojson(sort_keys=true) }}\n\
                 {{ meta | tojson(separators=[',', ':']) }}\n\
                 {{ [] | tojson(indent=2) }}{{ {} | tojson }}\n\
                 {{ meta | tojson(ensure_ascii=true) }}";
        let meta = json!({"b": 1, "a": [1, 2.5, {}], "c": "é<\"\n😀", "d": null, "e": true});
        assert_eq!(
            render_with(t, json!([]), json!({ "meta": meta })),
            "{\"b\": 1, \"a\": [1, 2.5, {}], \"c\": \"é<\\\"\\n😀\", \"d\": null, \"e\": true}\n\
             {\n  \"b\": 1,\n  \"a\": [\n    1,\n    2.5,\n    {}\n  ],\n  \"c\": \"é<\\\"\\n😀\",\n  \
             \"d\": null,\n  \"e\": true\n}\n\
             {\"a\": [1, 2.5, {}], \"b\": 1, \"c\": \"é<\\\"\\n😀\", \"d\": null, \"e\": true}\n\
             {\"b\":1,\"a\":[1,2.5,{}],\"c\":\"é<\\\"\\n😀\",\"d\":null,\"e\":true}\n\
             []{}\n\
             {\"b\": 1, \"a\": [1, 2.5, {}], \"c\": \"\\u00e9<\\\"\\n\\ud83d\\ude00\", \"d\": null, \
             \"e\": true}"
        );
    }

    #[test]
    fn loops_break_and_maps_keep_their_order() {
        let t = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}\
                 {{ m.content }}{% endfor %}|\
                 {% for k, v in meta.items() %}{{ k }}={{ v }};{% endfor %}";
        let m = json!([
            {"role": "user", "content": "one"},
            {"role": "user", "content": "two"},
        ]);
        assert_eq!(
            render_with(t, m, json!({"meta": {"z": 1, "a": 2}})),
            "one|z=1;a=2;"
        );
    }

    #[test]
    fn the_helpers_transformers_defines_are_there() {
        let failed = render("{{ raise_exception('no system role') }}", json!([]));
        assert!(failed.contains("no system role"), "{failed}");
        let now: u64 = render("{{ strftime_now('%s') }}", json!([]))
            .parse()
            .unwrap();
        let clock = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        assert!(now.abs_diff(clock) < 5, "{now} against {clock}");
        let date = render("{{ strftime_now('%d %b %Y') }}", json!([]));
        assert_eq!(date.len(), 11, "{date}");
    }

    #[test]
    fn generation_blocks_render_their_body() {
        let t = "{% for m in messages %}{%- generation -%}\n  [{{ m.content }}]\n\
                 {%- endgeneration %}{% endfor %}";
        let m = json!([{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]);
        // `transformers` 5.19 renders "[a][b]" for the same template.
        assert_eq!(render(t, m), "[a][b]");
        assert_eq!(
            generation_blocks_as_ifs(
                "x{% generation %}y{%+ endgeneration -%}{{ g }}{% generations %}"
            ),
            "x{% if true %}y{%+ endif -%}{{ g }}{% generations %}"
        );
    }

    #[test]
    fn a_loop_over_a_messages_content_asks_for_its_parts() {
        for (source, parts) in [
            ("{% for p in m['content'] %}{{ p.text }}{% endfor %}", true),
            ("{%- for part in message.content -%}{% endfor %}", true),
            (
                "{% for p in m[\"content\"] if p.type == 'text' %}{% endfor %}",
                true,
            ),
            (
                "{% for m in messages %}{{ m.content | trim }}{% endfor %}",
                false,
            ),
            ("{% for x in message.content_parts %}{% endfor %}", false),
            (
                "{{ m.content }}{% if m.content is string %}{% endif %}",
                false,
            ),
        ] {
            assert_eq!(loops_over_content(source), parts, "{source}");
        }
    }

    #[test]
    fn a_template_is_found_where_transformers_looks() {
        let dir = std::env::temp_dir().join(format!("kvroute-template-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let named = json!({"chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "plain"},
        ]});
        let found = |config: &Value, dir: Option<&Path>, explicit: Option<&Path>| {
            ChatTemplate::find(config, dir, explicit)
                .map(|t| t.map(|t| t.render(&json!([]), &ChatOptions::default()).unwrap()))
        };
        assert_eq!(found(&named, None, None).unwrap().as_deref(), Some("plain"));
        assert_eq!(found(&json!({}), None, None).unwrap(), None);
        let no_default = json!({"chat_template": [{"name": "rag", "template": "r"}]});
        assert!(found(&no_default, None, None).is_err());
        // A `chat_template.jinja` beside the config comes first; a file given explicitly
        // before both.
        std::fs::write(dir.join(CHAT_TEMPLATE_FILE), "from the file").unwrap();
        let beside = found(&named, Some(&dir), None).unwrap();
        assert_eq!(beside.as_deref(), Some("from the file"));
        let explicit = dir.join("mine.jinja");
        std::fs::write(&explicit, "explicit").unwrap();
        let chosen = found(&named, Some(&dir), Some(&explicit)).unwrap();
        assert_eq!(chosen.as_deref(), Some("explicit"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
