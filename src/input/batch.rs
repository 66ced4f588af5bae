//! Rows in the OpenAI batch shape: `{"custom_id", "method": "POST", "url", "body"}`, as
//! users write them for OpenAI's Batch API and vLLM's `run-batch`.
//!
//! `custom_id` is the item id; `url` `/v1/chat/completions` takes `body.messages`,
//! `/v1/completions` takes `body.prompt`; `body.tools` are the row's tools; the body's
//! sampling fields become a [`RowSampling`], applied per request within the dataset's
//! limits by [`RowSampling::apply`].
//!
//! Invariants: a batch row is taken in only when every key of its body is understood
//! (used, checked against the dataset, or known to change nothing); anything else rejects
//! the row with a reason naming the key. The dataset's limits win: a row's `max_tokens`
//! never raises the dataset's, a row's `stop` only adds stop strings, and `n` must be the
//! dataset's `samples`. What a row asks is stored as asked; limits are applied when the
//! request is built, so they are the dataset's of the run that sends it.

use super::row::type_name;
use crate::config::Sampling;
use crate::prompt::draw::Draw;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// The endpoint of a chat batch row.
pub const CHAT_URL: &str = "/v1/chat/completions";
/// The endpoint of a text-completion batch row.
pub const COMPLETIONS_URL: &str = "/v1/completions";

/// Sampling asked by one batch row's body, before the dataset's limits.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RowSampling {
    /// `max_completion_tokens`, else `max_tokens`: at most the dataset's `max_tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Replaces the dataset's temperature (and its per-generation draw).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    /// Replaces the dataset's top_p (and its draw).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    /// Replaces the dataset's top_k.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    /// Replaces the dataset's min_p.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f64>,
    /// Replaces the dataset's seed; sample s is sent seed + s, as for a dataset seed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Added to the dataset's stop strings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Vec<String>>,
}

impl RowSampling {
    /// Whether the row asked for nothing of its own.
    pub fn is_empty(&self) -> bool {
        *self == RowSampling::default()
    }

    /// The row's ask as the item stores it (a JSON object, keys in field order).
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }

    /// The row's ask from an item's stored extra (`{"sampling": {...}}`), when it has one.
    pub fn from_extra(extra: &Value) -> Option<RowSampling> {
        extra
            .get("sampling")
            .and_then(|v| serde_json::from_value(v.clone()).ok())
    }

    /// `draw` (the dataset's draw for generation `sample`) with this row's ask applied
    /// within the dataset's limits; the `sampling` record names every key the row set.
    pub fn apply(&self, draw: &mut Draw, sample: u32) {
        let s: &mut Sampling = &mut draw.sampling;
        let mut record: BTreeMap<String, Value> =
            serde_json::from_str(&draw.record).unwrap_or_default();
        if let Some(m) = self.max_tokens {
            s.max_tokens = s.max_tokens.min(m);
            record.insert("max_tokens".into(), Value::from(s.max_tokens));
        }
        if let Some(t) = self.temperature {
            s.temperature = t;
            record.insert("temperature".into(), Value::from(t));
        }
        if let Some(p) = self.top_p {
            s.top_p = p;
            record.insert("top_p".into(), Value::from(p));
        }
        if let Some(k) = self.top_k {
            s.top_k = Some(k);
            record.insert("top_k".into(), Value::from(k));
        }
        if let Some(p) = self.min_p {
            s.min_p = Some(p);
            record.insert("min_p".into(), Value::from(p));
        }
        if let Some(seed) = self.seed {
            let seed = seed.wrapping_add(u64::from(sample));
            s.seed = Some(seed);
            record.insert("seed".into(), Value::from(seed));
        }
        if let Some(stop) = &self.stop {
            let mut all = s.stop.clone().unwrap_or_default();
            for x in stop {
                if !all.contains(x) {
                    all.push(x.clone());
                }
            }
            record.insert("stop".into(), Value::from(all.clone()));
            s.stop = Some(all);
        }
        if let Ok(r) = serde_json::to_string(&record) {
            draw.record = r;
        }
    }
}

/// What a batch row asks for, once checked.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchRow {
    pub custom_id: String,
    /// `body.messages` (chat) or `body.prompt` (text completion), as a plain row holds it.
    pub input: Map<String, Value>,
    pub sampling: RowSampling,
}

/// Whether an object is a batch row (it has the batch shape's own keys).
pub fn is_batch_row(obj: &Map<String, Value>) -> bool {
    obj.contains_key("custom_id") || obj.contains_key("body")
}

/// The `custom_id` of a batch-shaped object, when it has a usable one (for a rejection).
pub fn custom_id_of(obj: &Map<String, Value>) -> Option<String> {
    match obj.get("custom_id") {
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        _ => None,
    }
}

/// Body keys that change nothing spool sends, whatever their value.
const IGNORED: &[&str] = &[
    "model",
    "stream",
    "stream_options",
    "user",
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
];

/// Checks a batch row and turns it into a plain row's fields. `samples` is the dataset's
/// generations per prompt (what `body.n` must be when given).
pub fn parse_batch(obj: &Map<String, Value>, samples: u32) -> Result<BatchRow, String> {
    for k in ["id", "prompt", "messages", "conversations"] {
        if obj.contains_key(k) {
            return Err(format!(
                "batch row: `{k}` at the top level; a batch row holds its request in `body` and its id in `custom_id`"
            ));
        }
    }
    let custom_id = match obj.get("custom_id") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(Value::String(_)) => return Err("batch row: `custom_id` is empty".into()),
        None => return Err("batch row: no `custom_id`".into()),
        Some(v) => {
            return Err(format!(
                "batch row: `custom_id` must be a string, not {}",
                type_name(v)
            ))
        }
    };
    match obj.get("method") {
        Some(Value::String(m)) if m == "POST" => {}
        Some(Value::String(m)) => {
            return Err(format!(
                "batch row: `method` is `{m}`; only `POST` is supported"
            ))
        }
        None => return Err("batch row: no `method` (it must be `POST`)".into()),
        Some(v) => {
            return Err(format!(
                "batch row: `method` must be the string `POST`, not {}",
                type_name(v)
            ))
        }
    }
    let url = match obj.get("url") {
        Some(Value::String(u)) => u.as_str(),
        None => return Err("batch row: no `url`".into()),
        Some(v) => {
            return Err(format!(
                "batch row: `url` must be a string, not {}",
                type_name(v)
            ))
        }
    };
    let chat = match url {
        CHAT_URL => true,
        COMPLETIONS_URL => false,
        other => {
            return Err(format!(
            "batch row: `url` `{other}` is not supported (use `{CHAT_URL}` or `{COMPLETIONS_URL}`)"
        ))
        }
    };
    let body = match obj.get("body") {
        Some(Value::Object(b)) => b,
        None => return Err("batch row: no `body`".into()),
        Some(v) => {
            return Err(format!(
                "batch row: `body` must be an object, not {}",
                type_name(v)
            ))
        }
    };
    let (want, other) = if chat {
        ("messages", "prompt")
    } else {
        ("prompt", "messages")
    };
    if body.contains_key(other) {
        return Err(format!(
            "batch row: `body.{other}` with `url` `{url}` (which takes `body.{want}`)"
        ));
    }
    let mut input = Map::new();
    match body.get(want) {
        None | Some(Value::Null) => {
            return Err(format!(
                "batch row: `body` has no `{want}` (`url` `{url}` needs it)"
            ))
        }
        Some(v) => {
            input.insert(want.into(), v.clone());
        }
    }
    let mut s = RowSampling::default();
    let mut max_tokens = None;
    let mut max_completion_tokens = None;
    for (k, v) in body {
        let key = format!("body.{k}");
        let bad = |what: &str| {
            Err::<(), String>(format!(
                "batch row: `{key}` must be {what}, not {}",
                match v {
                    Value::Number(n) => format!("{n}"),
                    other => type_name(other).to_string(),
                }
            ))
        };
        match k.as_str() {
            "messages" | "prompt" => {}
            "tools" => {
                input.insert("tools".into(), v.clone());
            }
            "max_tokens" | "max_completion_tokens" => {
                if v.is_null() {
                    continue;
                }
                let Some(n) = v.as_u64().filter(|n| *n >= 1) else {
                    bad("a positive integer")?;
                    continue;
                };
                let n = u32::try_from(n).unwrap_or(u32::MAX);
                if k == "max_tokens" {
                    max_tokens = Some(n);
                } else {
                    max_completion_tokens = Some(n);
                }
            }
            "temperature" => match v.as_f64() {
                Some(t) if (0.0..=2.0).contains(&t) => s.temperature = Some(t),
                _ if v.is_null() => {}
                _ => bad("a number from 0 to 2")?,
            },
            "top_p" => match v.as_f64() {
                Some(p) if p > 0.0 && p <= 1.0 => s.top_p = Some(p),
                _ if v.is_null() => {}
                _ => bad("a number above 0, at most 1")?,
            },
            "top_k" => match v.as_i64() {
                Some(t) if t >= -1 => s.top_k = Some(t),
                _ if v.is_null() => {}
                _ => bad("an integer, -1 or more")?,
            },
            "min_p" => match v.as_f64() {
                Some(p) if (0.0..=1.0).contains(&p) => s.min_p = Some(p),
                _ if v.is_null() => {}
                _ => bad("a number from 0 to 1")?,
            },
            "seed" => match (v.as_u64(), v.as_i64()) {
                (Some(n), _) => s.seed = Some(n),
                // A negative seed is its two's complement, as the server takes it as i64.
                (None, Some(n)) => s.seed = Some(n as u64),
                _ if v.is_null() => {}
                _ => bad("an integer")?,
            },
            "stop" => match v {
                Value::Null => {}
                Value::String(x) => s.stop = Some(vec![x.clone()]),
                Value::Array(a) => {
                    let mut out = Vec::with_capacity(a.len());
                    for (i, x) in a.iter().enumerate() {
                        match x {
                            Value::String(x) => out.push(x.clone()),
                            other => {
                                return Err(format!(
                                    "batch row: `body.stop[{i}]` must be a string, not {}",
                                    type_name(other)
                                ))
                            }
                        }
                    }
                    s.stop = Some(out);
                }
                _ => bad("a string or an array of strings")?,
            },
            "n" => match v.as_u64() {
                Some(n) if n == u64::from(samples) => {}
                Some(n) => {
                    return Err(format!(
                        "batch row: `body.n` is {n} but the dataset generates `samples = {samples}` per prompt (set `samples` in the dataset; `n` is not chosen per row)"
                    ))
                }
                _ if v.is_null() => {}
                _ => bad("a positive integer")?,
            },
            "tool_choice" => match v {
                Value::String(c) if c == "auto" => {}
                _ => {
                    return Err(format!(
                        "batch row: `body.tool_choice` {v} is not supported (only `auto`, the default)"
                    ))
                }
            },
            // Neutral values ask for the default, which is what is sent.
            "frequency_penalty" | "presence_penalty" if v.as_f64() == Some(0.0) => {}
            "repetition_penalty" if v.as_f64() == Some(1.0) => {}
            "logprobs" | "echo" if v.as_bool() == Some(false) => {}
            k if IGNORED.contains(&k) => {}
            _ => {
                return Err(format!(
                    "batch row: `{key}` is not supported per row (spool sends the dataset's sampling; remove it, or set it for the dataset)"
                ))
            }
        }
    }
    // OpenAI deprecates `max_tokens` for `max_completion_tokens`; the newer key wins.
    s.max_tokens = max_completion_tokens.or(max_tokens);
    Ok(BatchRow {
        custom_id,
        input,
        sampling: s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(o) => o,
            _ => panic!("not an object"),
        }
    }

    fn chat(body: Value) -> Map<String, Value> {
        obj(json!({"custom_id": "r1", "method": "POST", "url": CHAT_URL, "body": body}))
    }

    fn err(o: Map<String, Value>) -> String {
        parse_batch(&o, 1).unwrap_err()
    }

    /// A chat row gives its messages and sampling; `max_completion_tokens` wins over
    /// `max_tokens`; a one-string `stop` is a list of one.
    #[test]
    fn chat_rows_carry_messages_and_sampling() {
        let r = parse_batch(
            &chat(
                json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 50, "max_completion_tokens": 40, "temperature": 0.2,
                "top_p": 0.5, "seed": 7, "stop": "END", "n": 1,
                "tools": [{"type": "function", "function": {"name": "f"}}]}),
            ),
            1,
        )
        .unwrap();
        assert_eq!(r.custom_id, "r1");
        assert_eq!(r.input["messages"][0]["content"], "hi");
        assert!(r.input.contains_key("tools"));
        assert_eq!(
            r.sampling,
            RowSampling {
                max_tokens: Some(40),
                temperature: Some(0.2),
                top_p: Some(0.5),
                seed: Some(7),
                stop: Some(vec!["END".into()]),
                ..RowSampling::default()
            }
        );
        let r = parse_batch(
            &obj(
                json!({"custom_id": "p", "method": "POST", "url": COMPLETIONS_URL,
                "body": {"prompt": "once upon"}}),
            ),
            1,
        )
        .unwrap();
        assert_eq!(r.input["prompt"], "once upon");
        assert!(r.sampling.is_empty());
    }

    /// Each malformed batch row is refused with a reason naming its key.
    #[test]
    fn bad_batch_rows_name_the_key() {
        let m = json!([{"role": "user", "content": "hi"}]);
        let mut o = chat(json!({"messages": m}));
        o.insert("url".into(), json!("/v1/embeddings"));
        assert!(err(o).contains("`url` `/v1/embeddings`"));
        let mut o = chat(json!({"messages": m}));
        o.insert("method".into(), json!("GET"));
        assert!(err(o).contains("`method` is `GET`"));
        assert!(err(chat(json!({"max_tokens": 3}))).contains("no `messages`"));
        assert!(err(chat(json!({"messages": m, "max_tokens": "many"})))
            .contains("`body.max_tokens` must be a positive integer, not a string"));
        assert!(err(chat(json!({"messages": m, "max_tokens": 0})))
            .contains("`body.max_tokens` must be a positive integer, not 0"));
        assert!(err(chat(json!({"messages": m, "temperature": 9}))).contains("`body.temperature`"));
        assert!(err(chat(json!({"messages": m, "stop": [1]}))).contains("`body.stop[0]`"));
        assert!(err(chat(json!({"messages": m, "n": 3}))).contains("`samples = 1`"));
        assert!(err(chat(json!({"messages": m, "frequency_penalty": 0.5})))
            .contains("`body.frequency_penalty` is not supported"));
        assert!(err(chat(json!({"messages": m, "prompt": "x"}))).contains("`body.prompt`"));
        let mut o = chat(json!({"messages": m}));
        o.insert("custom_id".into(), json!(5));
        assert!(err(o).contains("`custom_id` must be a string"));
        let mut o = chat(json!({"messages": m}));
        o.remove("method");
        assert!(err(o).contains("no `method`"));
        assert!(parse_batch(&chat(json!({"messages": m, "n": 4})), 4).is_ok());
        assert!(parse_batch(&chat(json!({"messages": m, "frequency_penalty": 0})), 1).is_ok());
    }

    /// The row's ask is applied within the dataset's limits: `max_tokens` only lowers,
    /// `stop` only adds, the seed steps per sample, and the record names what was set.
    #[test]
    fn apply_keeps_the_dataset_limits() {
        let base = Sampling {
            max_tokens: 100,
            stop: Some(vec!["A".into()]),
            ..Sampling::default()
        };
        let draw = || Draw {
            sampling: base.clone(),
            chat_template_kwargs: Map::new(),
            record: r#"{"temperature":0.7,"top_p":0.95}"#.into(),
        };
        let ask = RowSampling {
            max_tokens: Some(500),
            temperature: Some(0.1),
            seed: Some(10),
            stop: Some(vec!["A".into(), "B".into()]),
            ..RowSampling::default()
        };
        let mut d = draw();
        ask.apply(&mut d, 2);
        assert_eq!(d.sampling.max_tokens, 100, "never above the dataset's");
        assert_eq!(d.sampling.temperature, 0.1);
        assert_eq!(d.sampling.seed, Some(12));
        assert_eq!(d.sampling.stop, Some(vec!["A".into(), "B".into()]));
        let rec: Value = serde_json::from_str(&d.record).unwrap();
        assert_eq!(
            rec,
            json!({"max_tokens": 100, "seed": 12, "stop": ["A", "B"], "temperature": 0.1, "top_p": 0.95})
        );
        let mut d = draw();
        RowSampling {
            max_tokens: Some(20),
            ..RowSampling::default()
        }
        .apply(&mut d, 0);
        assert_eq!(d.sampling.max_tokens, 20);
        let back = RowSampling::from_extra(&json!({"sampling": ask.to_value()})).unwrap();
        assert_eq!(back, ask);
    }
}
