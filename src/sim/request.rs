//! vLLM's request fields and validation, turned into an engine request.
//!
//! Accepts what vLLM's OpenAI server accepts for completions and chat (unknown fields are ignored,
//! as vLLM ignores them with a warning) and refuses what it refuses, with its 400/404 messages.
//! Deviations, stated: one choice per request (`n` must be 1, and a batch of prompts is refused),
//! and sampling fields other than the length controls and `seed` are accepted but do not change the
//! simulated text.

use serde::Deserialize;
use serde_json::Value;

use super::engine::{splitmix, EngineRequest};
use super::tokenizer::SimTokenizer;

pub use super::tokenizer::BOS;

#[derive(Debug)]
pub enum Reject {
    BadRequest(String),
    /// A bad value of one request field; vLLM names it in `param` and at the message's end.
    Param {
        message: String,
        param: &'static str,
    },
    /// The body is not JSON of the request's shape: message and `body.<offset>` as vLLM's
    /// request validation puts them.
    Json {
        message: String,
        param: String,
    },
    ModelNotFound(String),
}

impl Reject {
    /// vLLM 0.32's wording: `<why> (parameter=<name>, value=<value>)`.
    fn param(
        param: &'static str,
        why: impl std::fmt::Display,
        value: impl std::fmt::Display,
    ) -> Self {
        Self::Param {
            message: format!("{why} (parameter={param}, value={value})"),
            param,
        }
    }
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
    #[serde(default)]
    pub continuous_usage_stats: bool,
}

/// The fields of `/v1/completions` and `/v1/chat/completions` that shape the simulation.
#[derive(Debug, Default, Deserialize)]
pub struct RequestBody {
    pub model: Option<String>,
    pub prompt: Option<Value>,
    pub messages: Option<Vec<Message>>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub min_tokens: Option<i64>,
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<Value>,
    pub n: Option<i64>,
    /// What else of a chat request reaches the chat template, as in vLLM (`tools`,
    /// `chat_template_kwargs`, ...).
    #[serde(flatten)]
    pub chat: crate::tokenize::ChatOptions,
}

#[derive(Debug, Clone, Deserialize, serde::Serialize)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Value>,
    /// The message's other fields (an assistant's `tool_calls`, a tool result's
    /// `tool_call_id`, `name`, ...), which a model's chat template may render.
    #[serde(flatten)]
    pub rest: serde_json::Map<String, Value>,
}

/// A validated request: what to run and how to answer.
pub struct Parsed {
    pub engine: EngineRequest,
    pub stream: bool,
    pub include_usage: bool,
    pub continuous_usage: bool,
}

pub fn parse(body: &[u8]) -> Result<RequestBody, Reject> {
    serde_json::from_slice(body).map_err(|e| {
        // vLLM reports where the body went wrong as a character offset: `body.<offset>`.
        let text = String::from_utf8_lossy(body);
        let offset: usize = text
            .split('\n')
            .take(e.line().saturating_sub(1))
            .map(|l| l.chars().count() + 1)
            .sum::<usize>()
            + e.column().saturating_sub(1);
        let param = format!("body.{offset}");
        Reject::Json {
            message: format!(
                "1 validation error:\n  {{'type': 'json_invalid', 'loc': '{param}', 'msg': \
                 'JSON decode error', 'ctx': {{'error': '{e}'}}}}"
            ),
            param,
        }
    })
}

/// Renders chat messages with a ChatML template and the assistant generation prompt.
pub fn chat_template(messages: &[Message]) -> Result<String, Reject> {
    let mut text = String::new();
    for m in messages {
        let content = match &m.content {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut s = String::new();
                for p in parts {
                    match p.get("text").and_then(Value::as_str) {
                        Some(t) => s.push_str(t),
                        None => {
                            return Err(Reject::BadRequest(
                                "only text content parts are supported".into(),
                            ))
                        }
                    }
                }
                s
            }
            Some(_) => {
                return Err(Reject::BadRequest(
                    "message content must be a string or a list of parts".into(),
                ))
            }
        };
        text.push_str(&format!("<|im_start|>{}\n{content}<|im_end|>\n", m.role));
    }
    text.push_str("<|im_start|>assistant\n");
    Ok(text)
}

/// Prompt tokens of a completions `prompt`: text or token ids, one prompt.
fn prompt_tokens(prompt: &Value, tok: &SimTokenizer) -> Result<Vec<u32>, Reject> {
    let one = |v: &Value| -> Result<Vec<u32>, Reject> {
        match v {
            Value::String(s) => tok.prompt(s).map_err(|e| Reject::BadRequest(e.to_string())),
            Value::Array(ids) if ids.iter().all(Value::is_u64) => Ok(ids
                .iter()
                .filter_map(Value::as_u64)
                .map(|i| i as u32)
                .collect()),
            _ => Err(Reject::BadRequest(
                "prompt must be a string, a list of token ids, or a list of one of them".into(),
            )),
        }
    };
    match prompt {
        Value::Array(items) if !items.is_empty() && !items[0].is_u64() => {
            if items.len() != 1 {
                return Err(Reject::BadRequest(
                    "the simulator serves one prompt per request; send a batch as separate requests"
                        .into(),
                ));
            }
            one(&items[0])
        }
        other => one(other),
    }
}

/// A chat request's prompt tokens: the model's template and tokenizer when the worker has them,
/// else the simulator's ChatML rendering and split.
pub fn chat_tokens(
    messages: &[Message],
    options: &crate::tokenize::ChatOptions,
    tok: &SimTokenizer,
) -> Result<Vec<u32>, Reject> {
    let rendered = match tok {
        SimTokenizer::Own => chat_template(messages)?,
        SimTokenizer::Model(m) => {
            let value =
                serde_json::to_value(messages).map_err(|e| Reject::BadRequest(e.to_string()))?;
            m.render_chat(&value, options)
                .map_err(|e| Reject::BadRequest(e.to_string()))?
        }
    };
    tok.encode_chat(&rendered)
        .map_err(|e| Reject::BadRequest(e.to_string()))
}

pub fn validate(
    body: RequestBody,
    chat: bool,
    tok: &SimTokenizer,
    served_model: &str,
    max_model_len: usize,
) -> Result<Parsed, Reject> {
    if let Some(m) = &body.model {
        if m != served_model {
            return Err(Reject::ModelNotFound(format!(
                "The model `{m}` does not exist. Valid aliases: {served_model}."
            )));
        }
    }
    let prompt = if chat {
        let messages = body
            .messages
            .as_deref()
            .ok_or_else(|| Reject::BadRequest("Field required: messages".into()))?;
        chat_tokens(messages, &body.chat, tok)?
    } else {
        let p = body.prompt.as_ref().ok_or_else(|| Reject::Param {
            message: "Either prompt or prompt_embeds must be provided and non-empty. \
                          (parameter=prompt)"
                .into(),
            param: "prompt",
        })?;
        prompt_tokens(p, tok)?
    };
    if prompt.is_empty() {
        return Err(Reject::BadRequest("Prompt cannot be empty".into()));
    }
    check_sampling(&body)?;
    let requested = if chat {
        body.max_completion_tokens.or(body.max_tokens)
    } else {
        body.max_tokens
    };
    let max_tokens = output_budget(requested, prompt.len(), max_model_len, chat)?;
    let min_tokens = body.min_tokens.unwrap_or(0);
    if min_tokens < 0 || min_tokens as usize > max_tokens {
        return Err(Reject::BadRequest(format!(
            "min_tokens must be between 0 and max_tokens={max_tokens}, got {min_tokens}."
        )));
    }
    let stop = stop_strings(body.stop)?;
    let seed = match body.seed {
        Some(s) => s as u64,
        None => prompt
            .iter()
            .fold(0x243f_6a88_85a3_08d3, |h, t| splitmix(h ^ u64::from(*t))),
    };
    let opts = body.stream_options.unwrap_or_default();
    Ok(Parsed {
        engine: EngineRequest {
            prompt,
            max_tokens,
            min_tokens: min_tokens as usize,
            ignore_eos: body.ignore_eos,
            stop,
            seed,
        },
        stream: body.stream,
        include_usage: opts.include_usage,
        continuous_usage: opts.continuous_usage_stats,
    })
}

/// The sampling parameters the simulator refuses, as vLLM's API server words it (or, for `n`,
/// what it cannot do).
fn check_sampling(body: &RequestBody) -> Result<(), Reject> {
    if body.n.unwrap_or(1) != 1 {
        return Err(Reject::BadRequest(
            "n must be 1: the simulator generates one choice per request".into(),
        ));
    }
    if let Some(t) = body.temperature {
        if t < 0.0 {
            return Err(Reject::BadRequest(format!(
                "temperature must be non-negative, got {t}."
            )));
        }
    }
    if let Some(p) = body.top_p {
        if !(p > 0.0 && p <= 1.0) {
            return Err(Reject::BadRequest(format!(
                "top_p must be in (0, 1], got {p}."
            )));
        }
    }
    if body.stream_options.is_some() && !body.stream {
        return Err(Reject::BadRequest(
            "Stream options can only be defined when `stream=True`.".into(),
        ));
    }
    Ok(())
}

/// The output tokens a request may have: what it asked for (`requested`), or all the room its
/// prompt leaves; refused as vLLM refuses it when that is under 1, over the model's length, or
/// does not fit beside the prompt.
fn output_budget(
    requested: Option<i64>,
    prompt_len: usize,
    max_model_len: usize,
    chat: bool,
) -> Result<usize, Reject> {
    let room = max_model_len.saturating_sub(prompt_len);
    let max_tokens = match requested {
        Some(n) if n < 1 => {
            return Err(Reject::param(
                "max_tokens",
                format!("max_tokens must be at least 1, got {n}."),
                n,
            ))
        }
        Some(n) if n as usize > max_model_len => {
            return Err(Reject::param(
                "max_tokens",
                format!(
                    "max_tokens={n} cannot be greater than max_model_len={max_model_len}. \
                     Please request fewer output tokens."
                ),
                n,
            ))
        }
        Some(n) => n as usize,
        None => room,
    };
    if prompt_len + max_tokens > max_model_len || room == 0 {
        let what = if chat { "messages" } else { "prompt" };
        return Err(Reject::BadRequest(format!(
            "This model's maximum context length is {max_model_len} tokens. However, you requested \
             {} tokens ({} in the {what}, {max_tokens} in the completion). Please reduce the length \
             of the {what} or completion.",
            prompt_len + max_tokens,
            prompt_len
        )));
    }
    Ok(max_tokens)
}

/// `stop`: none, one string, or a list of strings.
fn stop_strings(stop: Option<Value>) -> Result<Vec<String>, Reject> {
    Ok(match stop {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s],
        Some(Value::Array(items)) => items
            .into_iter()
            .map(|v| match v {
                Value::String(s) => Ok(s),
                _ => Err(Reject::BadRequest(
                    "stop must be a string or a list of strings".into(),
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(Reject::BadRequest(
                "stop must be a string or a list of strings".into(),
            ))
        }
    })
}
