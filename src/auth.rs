//! Client API keys (`Authorization: Bearer <key>` on `/v1/` paths) with an optional in-flight
//! quota per key, and the key the gateway itself sends to workers.
//!
//! Keys are compared in constant time, every configured key each time, so the time a refusal
//! takes says nothing about how much of a key was right.

use std::sync::{
    atomic::{AtomicUsize, Ordering},
    Arc,
};

use http::{header, HeaderMap, HeaderValue};

use crate::{config::AuthConfig, error::ApiError};

/// One accepted client key.
#[derive(Debug)]
struct Client {
    name: String,
    key: Vec<u8>,
    max_inflight: usize,
    inflight: AtomicUsize,
}

/// The gateway's keys, resolved from the config at start-up.
#[derive(Debug, Default)]
pub struct Auth {
    clients: Vec<Arc<Client>>,
    /// `Bearer <worker key>`, sent to workers in place of the client's `Authorization`.
    pub worker_authorization: Option<HeaderValue>,
}

/// A request of an accepted client; holds one of the client's in-flight places until dropped.
#[derive(Debug)]
pub struct Permit {
    client: Arc<Client>,
}

impl Permit {
    pub fn client(&self) -> &str {
        &self.client.name
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.client.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

fn env(var: &str) -> Result<String, String> {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => Ok(v.trim().to_owned()),
        _ => Err(format!("environment variable {var} is unset or empty")),
    }
}

impl Auth {
    pub fn from_config(cfg: &AuthConfig) -> Result<Self, String> {
        let mut clients = Vec::with_capacity(cfg.client_keys.len());
        for k in &cfg.client_keys {
            let key = match (&k.key, &k.key_env) {
                (Some(key), None) if !key.is_empty() => key.clone(),
                (None, Some(var)) => {
                    env(var).map_err(|e| format!("client key {:?}: {e}", k.name))?
                }
                _ => {
                    return Err(format!(
                        "client key {:?}: give exactly one of key and key_env, not empty",
                        k.name
                    ))
                }
            };
            if k.name.is_empty() || clients.iter().any(|c: &Arc<Client>| c.name == k.name) {
                return Err(format!(
                    "client key names must be unique and not empty ({:?})",
                    k.name
                ));
            }
            clients.push(Arc::new(Client {
                name: k.name.clone(),
                key: key.into_bytes(),
                max_inflight: k.max_inflight,
                inflight: AtomicUsize::new(0),
            }));
        }
        let worker_authorization = match &cfg.worker_key_env {
            None => None,
            Some(var) => {
                let key = env(var).map_err(|e| format!("auth.worker_key_env: {e}"))?;
                let mut v = HeaderValue::try_from(format!("Bearer {key}")).map_err(|_| {
                    format!("auth.worker_key_env: {var} is not a valid header value")
                })?;
                v.set_sensitive(true);
                Some(v)
            }
        };
        Ok(Self {
            clients,
            worker_authorization,
        })
    }

    /// Whether clients must present a key.
    pub fn enabled(&self) -> bool {
        !self.clients.is_empty()
    }

    /// The client whose key `headers` carry, with one of its in-flight places taken: 401 without
    /// a valid key, 429 when the client is at its `max_inflight`.
    pub fn admit(&self, headers: &HeaderMap) -> Result<Permit, ApiError> {
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
            .map(|k| k.trim_ascii())
            .ok_or(ApiError::Unauthorized(
                "missing API key: send Authorization: Bearer <key>",
            ))?;
        let mut found = None;
        for c in &self.clients {
            if constant_time_eq(&c.key, presented) {
                found = Some(c);
            }
        }
        let client = found.ok_or(ApiError::Unauthorized("invalid API key"))?;
        let taken = client
            .inflight
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (client.max_inflight == 0 || n < client.max_inflight).then_some(n + 1)
            });
        if taken.is_err() {
            return Err(ApiError::QuotaExceeded {
                client: client.name.clone(),
                limit: client.max_inflight,
            });
        }
        Ok(Permit {
            client: Arc::clone(client),
        })
    }
}

/// Equal contents, in time that depends only on the lengths.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ClientKeyConfig;

    fn auth(max_inflight: usize) -> Auth {
        Auth::from_config(&AuthConfig {
            client_keys: vec![ClientKeyConfig {
                name: "team-a".into(),
                key: Some("sk-a".into()),
                key_env: None,
                max_inflight,
            }],
            worker_key_env: None,
        })
        .unwrap()
    }

    fn bearer(k: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            format!("Bearer {k}").parse().unwrap(),
        );
        h
    }

    #[test]
    fn only_a_configured_key_is_accepted() {
        let a = auth(0);
        assert_eq!(a.admit(&bearer("sk-a")).unwrap().client(), "team-a");
        assert!(matches!(
            a.admit(&bearer("sk-b")),
            Err(ApiError::Unauthorized(_))
        ));
        assert!(matches!(
            a.admit(&bearer("sk-")),
            Err(ApiError::Unauthorized(_))
        ));
        assert!(matches!(
            a.admit(&HeaderMap::new()),
            Err(ApiError::Unauthorized(_))
        ));
    }

    #[test]
    fn the_quota_counts_requests_until_their_permits_drop() {
        let a = auth(2);
        let p1 = a.admit(&bearer("sk-a")).unwrap();
        let _p2 = a.admit(&bearer("sk-a")).unwrap();
        assert!(matches!(
            a.admit(&bearer("sk-a")),
            Err(ApiError::QuotaExceeded { limit: 2, .. })
        ));
        drop(p1);
        assert!(a.admit(&bearer("sk-a")).is_ok());
    }

    #[test]
    fn a_key_must_be_given_once() {
        let cfg = AuthConfig {
            client_keys: vec![ClientKeyConfig {
                name: "x".into(),
                key: Some("k".into()),
                key_env: Some("K".into()),
                max_inflight: 0,
            }],
            worker_key_env: None,
        };
        assert!(Auth::from_config(&cfg).is_err());
    }
}
