//! The request's token ids, for routing on the workers' KV cache events: as many as routing
//! needs, on the request's path, and the rest of a chat's new text encoded after it.
//!
//! Between the routing key and the policy: the tokenizer of the request's model renders and
//! splits the prompt and takes the pieces it has seen from its cache. Little new text is encoded
//! at once. More is encoded only as far as a worker may hold it ([`crate::tokenize`]'s heads):
//! a worker's blocks chain from the prompt's start, so past the first block of the head that no
//! worker's events name, nothing can be cached anywhere, and the policy is given the head and an
//! estimate of the tokens after it. Where a worker holds the whole head, or heads are off, the
//! whole prompt is encoded, long new text on the blocking pool so the event loop keeps serving.

use std::sync::{
    atomic::{AtomicUsize, Ordering},
    Arc,
};

use crate::{
    proxy::Upstreams,
    routing_key::{PromptField, RequestInfo},
    tokenize::{ModelTokenizer, Pending, TokenizeError, HEAD_BYTES},
    workers::Worker,
};

/// Text to encode above which tokenizing moves to the blocking pool (about 0.1 ms of encoding
/// with a Llama 3 vocabulary; four times that or more before the byte-level road): below, the
/// hand-off would cost more than it saves; above, the event loop would stall every other
/// connection it serves.
const INLINE_TOKENIZE_BYTES: usize = 2048;

/// The request's token ids as its model's worker will see them, when a tokenizer is configured
/// for the model (or one is configured and the request names none). A request the tokenizer
/// cannot take (token-id prompts, a template error) is routed without them. Pieces of a chat seen
/// before come from the tokenizer's cache on the event loop; long new text is encoded on the
/// blocking pool. Sets `info.tokens` and `info.tokens_after`.
///
/// Counted in `kvroute_tokenized_requests_total` by how: `whole`, `head`, or `untokenized`.
pub async fn attach(up: &Upstreams, info: &mut RequestInfo, body: &[u8], field: PromptField) {
    let tokenizer = match &info.model {
        Some(m) => up.tokenizers.get(m),
        None if up.tokenizers.len() == 1 => up.tokenizers.values().next(),
        None => None,
    };
    let Some(tokenizer) = tokenizer else { return };
    let workers = up.pool.snapshot();
    // A request for a LoRA adapter the workers' events have shown chains from its root.
    info.token_root =
        crate::kv_events::request_root(&workers, info.model.as_deref(), info.token_root);
    let counted = &up.metrics.tokenized;
    let chain = (&workers[..], info.token_root);
    let how = match tokens_of(up, tokenizer, body, field, chain).await {
        Some((tokens, after)) => {
            info.tokens = Some(tokens.into());
            info.tokens_after = u32::try_from(after).unwrap_or(u32::MAX);
            if after > 0 {
                &counted.head
            } else {
                &counted.whole
            }
        }
        None => &counted.untokenized,
    };
    how.inc();
}

/// The token ids routing needs and the estimated tokens after them.
async fn tokens_of(
    up: &Upstreams,
    tokenizer: &Arc<ModelTokenizer>,
    body: &[u8],
    field: PromptField,
    chain: (&[Arc<Worker>], u64),
) -> Option<(Vec<u32>, usize)> {
    // Only the field the tokenizer reads is built; the rest of the body is skipped.
    #[derive(serde::Deserialize)]
    struct Prompt<'a> {
        #[serde(borrow)]
        prompt: Option<std::borrow::Cow<'a, str>>,
        messages: Option<serde_json::Value>,
        instructions: Option<serde_json::Value>,
        input: Option<serde_json::Value>,
        // What else of a chat request reaches its template.
        tools: Option<serde_json::Value>,
        chat_template_kwargs: Option<serde_json::Value>,
        add_generation_prompt: Option<bool>,
        continue_final_message: Option<bool>,
        documents: Option<serde_json::Value>,
        reasoning_effort: Option<serde_json::Value>,
    }
    let p: Prompt = serde_json::from_slice(body).ok()?;
    let pending = match field {
        PromptField::Prompt => Ok(tokenizer.prepare_prompt(&p.prompt?)),
        PromptField::Messages => {
            let options = crate::tokenize::ChatOptions {
                tools: p.tools,
                chat_template_kwargs: p.chat_template_kwargs,
                add_generation_prompt: p.add_generation_prompt,
                continue_final_message: p.continue_final_message,
                documents: p.documents,
                reasoning_effort: p.reasoning_effort,
            };
            tokenizer.prepare_chat_with(&p.messages?, &options)
        }
        PromptField::Input => tokenizer.prepare_chat(&crate::responses::chat_messages(
            p.instructions.as_ref(),
            &p.input?,
        )?),
    };
    let tokens = match pending {
        Ok(p) if p.uncached_bytes() > 2 * HEAD_BYTES && tokenizer.encodes_heads() => {
            head_or_whole(up, tokenizer, p, chain).await
        }
        Ok(p) => whole(tokenizer, p).await.map(|t| (t, 0)),
        Err(e) => Err(e),
    };
    match tokens {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::debug!(error = %e, "request not tokenized; routed without exact cache state");
            None
        }
    }
}

/// The most new text a head grows to (from [`HEAD_BYTES`], four times at a time) before the
/// whole prompt is encoded instead.
const MAX_HEAD_BYTES: usize = 1024;

/// The request's head when no worker's events reach past it, with the estimated tokens after;
/// otherwise the whole prompt. What a head leaves of a chat's new pieces is encoded afterwards on
/// the blocking pool, off the request's path, so the conversation's next turn finds them cached.
async fn head_or_whole(
    up: &Upstreams,
    tokenizer: &Arc<ModelTokenizer>,
    pending: Pending,
    (workers, root): (&[Arc<Worker>], u64),
) -> Result<(Vec<u32>, usize), TokenizeError> {
    let mut budget = HEAD_BYTES;
    while budget <= MAX_HEAD_BYTES {
        let head = tokenizer.head(&pending, budget)?;
        if head.rest_tokens == 0 {
            return Ok((head.ids, 0));
        }
        if !crate::kv_events::some_worker_holds_all(workers, &head.ids, root) {
            if pending.fills_cache() && !fill_cache_later(tokenizer, pending) {
                up.metrics.tokenize_fills_skipped.inc();
            }
            return Ok((head.ids, head.rest_tokens));
        }
        budget *= 4;
    }
    whole(tokenizer, pending).await.map(|t| (t, 0))
}

/// Background fills of the piece cache under way, and the most allowed at once: past that, under
/// a burst of new text, a fill is skipped (the conversation's next turn encodes that text itself)
/// rather than queueing encoding work that no request waits for.
static FILLS: AtomicUsize = AtomicUsize::new(0);
const MAX_FILLS: usize = 8;

/// Encodes what a head left of a chat's new pieces on the blocking pool, caching them, unless
/// [`MAX_FILLS`] are under way; false when skipped.
fn fill_cache_later(tokenizer: &Arc<ModelTokenizer>, pending: Pending) -> bool {
    /// One fill under way, counted in [`FILLS`] until dropped, however the fill ends.
    struct Fill;
    impl Drop for Fill {
        fn drop(&mut self) {
            FILLS.fetch_sub(1, Ordering::Relaxed);
        }
    }
    let fill = Fill;
    if FILLS.fetch_add(1, Ordering::Relaxed) >= MAX_FILLS {
        return false;
    }
    let tokenizer = Arc::clone(tokenizer);
    tokio::task::spawn_blocking(move || {
        let _fill = fill;
        // A failure here costs only the cache entry; the request was routed on its head.
        let _ = tokenizer.finish(pending);
    });
    true
}

/// The whole prompt's ids; long new text is encoded on the blocking pool.
async fn whole(
    tokenizer: &Arc<ModelTokenizer>,
    pending: Pending,
) -> Result<Vec<u32>, TokenizeError> {
    if pending.uncached_bytes() <= INLINE_TOKENIZE_BYTES {
        return tokenizer.finish(pending);
    }
    let tokenizer = Arc::clone(tokenizer);
    tokio::task::spawn_blocking(move || tokenizer.finish(pending))
        .await
        .unwrap_or_else(|e| Err(TokenizeError::Encode(e.to_string())))
}
