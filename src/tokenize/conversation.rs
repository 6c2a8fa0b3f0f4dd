//! A chat request as vLLM 0.32 hands it to the chat template: the messages as its parser leaves
//! them, the tools as its request model writes them out, and the template's other variables.
//!
//! The template sees what vLLM made of the request, not the request: a message's content parts
//! joined into one string for a template that reads `content` as a string (its "string" content
//! format), or kept as `{"type": "text", ...}` parts for one that loops over them ("openai"); an
//! assistant's tool call arguments parsed from their JSON text into a map (`{}` where they are
//! not a JSON object); a tool result's text parts joined; each tool written as pydantic dumps
//! vLLM's `ChatCompletionToolsParam` (absent fields as `null`, unknown ones dropped). A request
//! this cannot render as vLLM would (images or audio, a developer message the template has no
//! role for, `continue_final_message`) is an error, so it is routed without exact cache state
//! rather than on tokens the worker would not see.

use minijinja::Value as JinjaValue;
use serde_json::{json, Map, Value};

use super::TokenizeError;

/// The parts of a chat request besides its messages that reach the template (vLLM's
/// `ChatCompletionRequest` fields of those names).
#[derive(Clone, Debug, Default, serde::Deserialize)]
pub struct ChatOptions {
    pub tools: Option<Value>,
    pub chat_template_kwargs: Option<Value>,
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
    pub documents: Option<Value>,
    pub reasoning_effort: Option<Value>,
}

fn unsupported(what: &str) -> TokenizeError {
    TokenizeError::Template(format!("not rendered as vLLM would: {what}"))
}

/// The template's variables for `messages` and `options`, besides the special tokens: the
/// conversation, `tools`, `documents`, `add_generation_prompt`, and the request's
/// `chat_template_kwargs` (vLLM's own overriding them where it sets one), over the server's
/// `defaults` (which a request's value overrides unless it is `null` or `"auto"`, as vLLM merges
/// them). The messages' text is copied once, into the template's values.
pub(super) fn variables(
    messages: &Value,
    options: &ChatOptions,
    defaults: &Map<String, Value>,
    openai_content: bool,
    template_knows_developer: bool,
) -> Result<Vec<(String, JinjaValue)>, TokenizeError> {
    if options.continue_final_message == Some(true) {
        return Err(unsupported("continue_final_message"));
    }
    let mut vars: Vec<(String, Value)> = Vec::new();
    if let Some(kwargs) = &options.chat_template_kwargs {
        let Value::Object(kwargs) = kwargs else {
            return Err(unsupported("chat_template_kwargs is not an object"));
        };
        if kwargs.contains_key("chat_template") || kwargs.contains_key("tokenize") {
            return Err(unsupported(
                "chat_template_kwargs naming chat_template or tokenize",
            ));
        }
        vars.extend(kwargs.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    let mut set = |name: &str, v: Value| match vars.iter_mut().find(|(k, _)| k == name) {
        Some(slot) => slot.1 = v,
        None => vars.push((name.to_owned(), v)),
    };
    let user_thinking = options
        .chat_template_kwargs
        .as_ref()
        .is_some_and(|k| k.get("enable_thinking").is_some());
    set(
        "add_generation_prompt",
        Value::Bool(options.add_generation_prompt.unwrap_or(true)),
    );
    if let Some(d) = options.documents.as_ref().filter(|d| !d.is_null()) {
        set("documents", d.clone());
    }
    if let Some(effort) = options.reasoning_effort.as_ref().filter(|e| !e.is_null()) {
        set("reasoning_effort", effort.clone());
        if !user_thinking {
            set("enable_thinking", Value::Bool(effort != "none"));
        }
    }
    vars.retain(|(k, _)| k != "continue_final_message");
    if !defaults.is_empty() {
        vars = over_defaults(defaults, vars);
    }
    if !vars.iter().any(|(k, _)| k == "documents") {
        vars.push(("documents".into(), Value::Null));
    }
    vars.push(("tools".into(), tools(options.tools.as_ref())?));
    let conversation = conversation(messages, openai_content, template_knows_developer)?;
    let mut out: Vec<(String, JinjaValue)> = vars
        .into_iter()
        .map(|(k, v)| (k, JinjaValue::from_serialize(&v)))
        .collect();
    out.push(("messages".into(), conversation));
    Ok(out)
}

/// The request's variables over the server's defaults, as vLLM merges them: a request's value
/// replaces a default unless it is `null` or `"auto"`.
fn over_defaults(
    defaults: &Map<String, Value>,
    vars: Vec<(String, Value)>,
) -> Vec<(String, Value)> {
    let mut merged: Vec<(String, Value)> = defaults
        .iter()
        .filter(|(k, _)| *k != "continue_final_message")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    for (k, v) in vars {
        if v.is_null() || v == "auto" {
            continue;
        }
        match merged.iter_mut().find(|(name, _)| *name == k) {
            Some(slot) => slot.1 = v,
            None => merged.push((k, v)),
        }
    }
    merged
}

/// The request's `tools` as the template gets them: `null` without any.
fn tools(tools: Option<&Value>) -> Result<Value, TokenizeError> {
    match tools {
        None | Some(Value::Null) => Ok(Value::Null),
        Some(Value::Array(tools)) => Ok(Value::Array(
            tools.iter().map(tool).collect::<Result<Vec<_>, _>>()?,
        )),
        Some(_) => Err(unsupported("tools is not a list")),
    }
}

/// One tool as vLLM writes its `ChatCompletionToolsParam` out: `type`, `function` (`name`,
/// `description` and `parameters`, `null` when absent; `strict` and `defer_loading` only when
/// given), and `defer_loading` when given, which the function takes too unless it has its own.
fn tool(t: &Value) -> Result<Value, TokenizeError> {
    let f = t
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| unsupported("a tool without a function"))?;
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| unsupported("a tool function without a name"))?;
    let defer = t.get("defer_loading").filter(|d| !d.is_null());
    let mut function = Map::new();
    function.insert("name".into(), Value::from(name));
    for k in ["description", "parameters"] {
        function.insert(k.into(), f.get(k).cloned().unwrap_or(Value::Null));
    }
    if let Some(strict) = f.get("strict").filter(|s| !s.is_null()) {
        function.insert("strict".into(), strict.clone());
    }
    if let Some(d) = f.get("defer_loading").filter(|d| !d.is_null()).or(defer) {
        function.insert("defer_loading".into(), d.clone());
    }
    let mut out = Map::new();
    out.insert("type".into(), Value::from("function"));
    out.insert("function".into(), Value::Object(function));
    if let Some(d) = defer {
        out.insert("defer_loading".into(), d.clone());
    }
    Ok(Value::Object(out))
}

/// The messages as vLLM's parser leaves them for the template.
fn conversation(
    messages: &Value,
    openai_content: bool,
    template_knows_developer: bool,
) -> Result<JinjaValue, TokenizeError> {
    let messages = messages
        .as_array()
        .ok_or_else(|| unsupported("messages is not a list"))?;
    let mut out = Vec::with_capacity(messages.len());
    for m in messages {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| unsupported("a message without a role"))?;
        if role == "developer" && !template_knows_developer {
            return Err(unsupported(
                "a developer message the template has no role for",
            ));
        }
        let texts = texts(m.get("content"))?;
        let joined = || match texts.as_slice() {
            [one] => JinjaValue::from(*one),
            many => JinjaValue::from(many.join("\n")),
        };
        let mut msg: Vec<(&str, JinjaValue)> = Vec::with_capacity(4);
        msg.push(("role", JinjaValue::from(role)));
        // A tool result's text parts are joined whatever the format.
        if openai_content && role != "tool" {
            let parts = texts.iter().map(|t| {
                JinjaValue::from_iter([
                    ("type", JinjaValue::from("text")),
                    ("text", JinjaValue::from(*t)),
                ])
            });
            msg.push(("content", JinjaValue::from(parts.collect::<Vec<_>>())));
        } else {
            msg.push(("content", joined()));
        }
        let json = |v: &Value| JinjaValue::from_serialize(v);
        match role {
            "assistant" => {
                if let Some(calls) = m.get("tool_calls").filter(|c| !c.is_null()) {
                    if let Some(calls) = tool_calls(calls)? {
                        msg.push(("tool_calls", json(&calls)));
                    }
                }
                if let Some(r) = m.get("reasoning").filter(|r| !r.is_null()) {
                    msg.push(("reasoning", json(r)));
                    msg.push(("reasoning_content", json(r)));
                }
            }
            "tool" => {
                if let Some(id) = m.get("tool_call_id") {
                    msg.push(("tool_call_id", json(id)));
                }
            }
            "developer" => {
                msg.push(("tools", json(m.get("tools").unwrap_or(&Value::Null))));
            }
            _ => {}
        }
        for k in ["name", "task"] {
            if let Some(v) = m.get(k).filter(|v| v.is_string()) {
                msg.push((k, json(v)));
            }
        }
        out.push(JinjaValue::from_iter(msg));
    }
    Ok(JinjaValue::from(out))
}

/// A message's text parts (a string is one); anything else (an image, audio) is refused.
fn texts(content: Option<&Value>) -> Result<Vec<&str>, TokenizeError> {
    match content {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.as_str()]),
        Some(Value::Array(parts)) => {
            let mut out = Vec::with_capacity(parts.len());
            for p in parts {
                if let Some(s) = p.as_str() {
                    out.push(s);
                    continue;
                }
                let field = match p.get("type").and_then(Value::as_str) {
                    Some("text" | "input_text" | "output_text") => "text",
                    Some("refusal") => "refusal",
                    _ => return Err(unsupported("a content part that is not text")),
                };
                match p.get(field) {
                    Some(Value::String(s)) => out.push(s.as_str()),
                    None | Some(Value::Null) => {}
                    Some(_) => return Err(unsupported("a text part without text")),
                }
            }
            Ok(out)
        }
        Some(_) => Err(unsupported("content is neither text nor a list of parts")),
    }
}

/// An assistant's tool calls with their arguments parsed into a map, as vLLM passes them
/// (templates expect a map); `None` for an empty list, which vLLM drops.
fn tool_calls(calls: &Value) -> Result<Option<Value>, TokenizeError> {
    let Value::Array(calls) = calls else {
        return Ok(Some(calls.clone()));
    };
    if calls.is_empty() {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(calls.len());
    for call in calls {
        let mut call = call
            .as_object()
            .cloned()
            .ok_or_else(|| unsupported("a tool call that is not an object"))?;
        if call
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("function")
            != "function"
        {
            return Err(unsupported("a tool call that is not a function's"));
        }
        let Some(Value::Object(function)) = call.get_mut("function") else {
            return Err(unsupported("a tool call without a function"));
        };
        let parsed = match function.get("arguments") {
            Some(Value::Object(m)) if !m.is_empty() => Value::Object(m.clone()),
            Some(Value::String(s)) if !s.is_empty() => match serde_json::from_str(s) {
                Ok(Value::Object(m)) => Value::Object(m),
                _ => json!({}),
            },
            _ => json!({}),
        };
        function.insert("arguments".into(), parsed);
        out.push(Value::Object(call));
    }
    Ok(Some(Value::Array(out)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(messages: Value, options: &ChatOptions, openai: bool) -> Map<String, Value> {
        variables(&messages, options, &Map::new(), openai, false)
            .unwrap()
            .into_iter()
            .map(|(k, v)| (k, serde_json::to_value(&v).unwrap()))
            .collect()
    }

    #[test]
    fn content_parts_are_joined_or_kept_as_the_template_reads_them() {
        let m = json!([
            {"role": "user", "content": [{"type": "text", "text": "a"}, "b",
                                         {"type": "input_text", "text": "c"}]},
            {"role": "tool", "tool_call_id": "t", "content": [{"type": "text", "text": "x"},
                                                              {"type": "text", "text": "y"}]},
            {"role": "assistant", "content": null, "name": "bot", "extra": 1},
        ]);
        let string = vars(m.clone(), &ChatOptions::default(), false);
        assert_eq!(
            string["messages"],
            json!([
                {"role": "user", "content": "a\nb\nc"},
                {"role": "tool", "content": "x\ny", "tool_call_id": "t"},
                {"role": "assistant", "content": "", "name": "bot"},
            ])
        );
        let parts = vars(m, &ChatOptions::default(), true);
        assert_eq!(
            parts["messages"][0]["content"],
            json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"},
                   {"type": "text", "text": "c"}])
        );
        assert_eq!(
            parts["messages"][1]["content"], "x\ny",
            "a tool result's joined anyway"
        );
        assert_eq!(parts["messages"][2]["content"], json!([]));
    }

    #[test]
    fn tool_call_arguments_become_a_map_as_vllm_parses_them() {
        let call = |args: Value| {
            json!({"role": "assistant", "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": args}}]})
        };
        let args = |a: Value| {
            let v = vars(json!([call(a)]), &ChatOptions::default(), false);
            v["messages"][0]["tool_calls"][0]["function"]["arguments"].clone()
        };
        assert_eq!(
            args(json!("{\"b\": 1, \"a\": [2]}")),
            json!({"b": 1, "a": [2]})
        );
        assert_eq!(args(json!("not json")), json!({}));
        assert_eq!(
            args(json!("[1, 2]")),
            json!({}),
            "valid JSON, not an object"
        );
        assert_eq!(args(json!("")), json!({}));
        assert_eq!(args(json!({"k": "v"})), json!({"k": "v"}));
        assert_eq!(args(Value::Null), json!({}));
        let empty = json!([{"role": "assistant", "content": "hi", "tool_calls": []}]);
        let v = vars(empty, &ChatOptions::default(), false);
        assert!(
            v["messages"][0].get("tool_calls").is_none(),
            "an empty list is dropped"
        );
    }

    #[test]
    fn tools_are_written_as_vllms_request_model_dumps_them() {
        let options = ChatOptions {
            tools: Some(json!([
                {"type": "function", "function": {"name": "f"}, "other": 1},
                {"function": {"parameters": {"z": 1, "a": 2}, "name": "g", "strict": true,
                              "description": "G", "extra": true},
                 "defer_loading": true},
            ])),
            ..ChatOptions::default()
        };
        let v = vars(json!([]), &options, false);
        assert_eq!(
            v["tools"],
            json!([
                {"type": "function", "function": {"name": "f", "description": null,
                                                  "parameters": null}},
                {"type": "function", "function": {"name": "g", "description": "G",
                    "parameters": {"z": 1, "a": 2}, "strict": true, "defer_loading": true},
                 "defer_loading": true},
            ])
        );
        // Key order matters to `tojson`: as the model declares its fields.
        let keys: Vec<_> = v["tools"][1]["function"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        assert_eq!(
            keys,
            [
                "name",
                "description",
                "parameters",
                "strict",
                "defer_loading"
            ]
        );
        assert_eq!(
            vars(json!([]), &ChatOptions::default(), false)["tools"],
            Value::Null
        );
    }

    #[test]
    fn the_templates_other_variables_are_vllms() {
        let options = ChatOptions {
            chat_template_kwargs: Some(json!({"add_generation_prompt": true, "custom": 1})),
            add_generation_prompt: Some(false),
            reasoning_effort: Some(json!("none")),
            ..ChatOptions::default()
        };
        let v = vars(json!([]), &options, false);
        assert_eq!(
            v["add_generation_prompt"], false,
            "the request's own field wins"
        );
        assert_eq!(v["custom"], 1);
        assert_eq!(v["reasoning_effort"], "none");
        assert_eq!(v["enable_thinking"], false);
        assert_eq!(v["documents"], Value::Null);
        let mine = ChatOptions {
            chat_template_kwargs: Some(json!({"enable_thinking": true})),
            reasoning_effort: Some(json!("none")),
            ..ChatOptions::default()
        };
        assert_eq!(vars(json!([]), &mine, false)["enable_thinking"], true);
        // The server's defaults, under the request's values that are set.
        let defaults = json!({"enable_thinking": false, "style": "terse", "custom": 0});
        let request = ChatOptions {
            chat_template_kwargs: Some(json!({"custom": 1, "style": null})),
            ..ChatOptions::default()
        };
        let merged: Map<String, Value> = variables(
            &json!([]),
            &request,
            defaults.as_object().unwrap(),
            false,
            false,
        )
        .unwrap()
        .into_iter()
        .map(|(k, v)| (k, serde_json::to_value(&v).unwrap()))
        .collect();
        assert_eq!(merged["enable_thinking"], false);
        assert_eq!(
            merged["style"], "terse",
            "a null does not override a default"
        );
        assert_eq!(merged["custom"], 1);
        assert_eq!(merged["add_generation_prompt"], true);
    }

    #[test]
    fn what_vllm_would_render_otherwise_is_refused() {
        let plain = json!([{"role": "user", "content": "hi"}]);
        let refused = |messages: &Value, options: &ChatOptions, developer: bool| {
            variables(messages, options, &Map::new(), false, developer).is_err()
        };
        let continued = ChatOptions {
            continue_final_message: Some(true),
            ..ChatOptions::default()
        };
        assert!(refused(&plain, &continued, false));
        let image = json!([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:,"}}]}]);
        assert!(refused(&image, &ChatOptions::default(), false));
        let developer = json!([{"role": "developer", "content": "be brief"}]);
        assert!(refused(&developer, &ChatOptions::default(), false));
        assert!(!refused(&developer, &ChatOptions::default(), true));
        let reserved = ChatOptions {
            chat_template_kwargs: Some(json!({"tokenize": false})),
            ..ChatOptions::default()
        };
        assert!(refused(&plain, &reserved, false));
        assert!(!refused(&plain, &ChatOptions::default(), false));
    }
}
