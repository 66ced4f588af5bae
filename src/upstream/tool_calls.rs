//! The tool calls of a chat answer, read into one shape whether they came whole or in
//! stream fragments: a JSON array of `{"id", "type", "function": {"name", "arguments"}}`,
//! in the order the server numbered them.
//!
//! Whole answers carry `message.tool_calls` complete; streams carry `delta.tool_calls`
//! fragments keyed by `index`, the `id`, `type` and `function.name` on a call's first
//! fragment and `function.arguments` as string pieces to append. An `id` the server never
//! sent is `null`; a `type` it never sent is `"function"`; `arguments` an object (some
//! servers' shape) is kept as its JSON text, since OpenAI's is a string.
//!
//! Invariants: a field of the wrong JSON type is [`UpstreamError::Malformed`] naming the
//! field's path (e.g. `delta.tool_calls[0].function.name`), never skipped or coerced; an
//! absent, `null` or empty `tool_calls` is no calls (vLLM sends `[]` with every answer);
//! a call without a function name is malformed; what a stream's calls hold is counted by
//! [`Assembler::retained`] so the caller can cap it.

use super::UpstreamError;
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// A whole answer's `tool_calls` (`at` names it, e.g. `message.tool_calls`) in the one
/// shape; `None` when it holds no call.
pub(super) fn whole(v: Option<&Value>, at: &str) -> Result<Option<Value>, UpstreamError> {
    let Some(calls) = list(v, at)? else {
        return Ok(None);
    };
    let mut out = Vec::with_capacity(calls.len());
    for (k, call) in calls.iter().enumerate() {
        let at = format!("{at}[{k}]");
        let f = fragment(call, &at)?;
        let name = f
            .name
            .filter(|n| !n.is_empty())
            .ok_or_else(|| UpstreamError::Malformed(format!("`{at}.function` has no `name`")))?;
        out.push(shaped(f.id, f.kind, name, f.arguments.unwrap_or_default()));
    }
    Ok(Some(Value::Array(out)))
}

/// Streamed tool-call fragments, assembled by `index`.
#[derive(Debug, Default)]
pub(super) struct Assembler {
    calls: BTreeMap<u32, Partial>,
    /// Bytes held by `calls` (strings plus a fixed cost per call).
    held: usize,
}

/// One call being assembled.
#[derive(Debug, Default)]
struct Partial {
    id: Option<String>,
    kind: Option<String>,
    name: String,
    arguments: String,
}

/// What each call costs beyond its strings (the entry, a share of its map node, the
/// strings' allocations), so that many small calls count what they hold.
const CALL_OVERHEAD: usize = std::mem::size_of::<Partial>() + 64;

impl Assembler {
    /// Folds in one event's `delta.tool_calls` (`at` names it); returns whether it held
    /// any fragment (a generated piece, for the chunk count).
    pub(super) fn push(&mut self, v: Option<&Value>, at: &str) -> Result<bool, UpstreamError> {
        let Some(frags) = list(v, at)? else {
            return Ok(false);
        };
        for (k, frag) in frags.iter().enumerate() {
            let at = format!("{at}[{k}]");
            // Every streamed fragment names its call; one that does not is the k-th.
            let index = match frag.get("index") {
                None | Some(Value::Null) => u32::try_from(k).unwrap_or(u32::MAX),
                Some(i) => i
                    .as_u64()
                    .and_then(|i| u32::try_from(i).ok())
                    .ok_or_else(|| {
                        UpstreamError::Malformed(format!("`{at}.index` is {i}, not a call index"))
                    })?,
            };
            let f = fragment(frag, &at)?;
            let call = self.calls.entry(index).or_insert_with(|| {
                self.held += CALL_OVERHEAD;
                Partial::default()
            });
            // The first id, type and name stand: servers that repeat them on every
            // fragment repeat the same ones.
            if call.id.is_none() {
                if let Some(id) = f.id {
                    self.held += id.len();
                    call.id = Some(id.to_string());
                }
            }
            if call.kind.is_none() {
                if let Some(kind) = f.kind {
                    self.held += kind.len();
                    call.kind = Some(kind.to_string());
                }
            }
            if call.name.is_empty() {
                if let Some(name) = f.name {
                    self.held += name.len();
                    call.name.push_str(name);
                }
            }
            if let Some(args) = f.arguments {
                self.held += args.len();
                call.arguments.push_str(&args);
            }
        }
        Ok(!frags.is_empty())
    }

    /// Bytes the assembled calls hold.
    pub(super) fn retained(&self) -> usize {
        self.held
    }

    /// The calls in index order, in the one shape; `None` when the stream sent none.
    pub(super) fn finish(self) -> Result<Option<Value>, UpstreamError> {
        if self.calls.is_empty() {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(self.calls.len());
        for (index, c) in self.calls {
            if c.name.is_empty() {
                return Err(UpstreamError::Malformed(format!(
                    "the stream's tool call {index} has no `function.name`"
                )));
            }
            out.push(shaped(
                c.id.as_deref(),
                c.kind.as_deref(),
                &c.name,
                c.arguments,
            ));
        }
        Ok(Some(Value::Array(out)))
    }
}

/// The calls of a `tool_calls` field: `None` when absent, `null` or empty.
fn list<'v>(v: Option<&'v Value>, at: &str) -> Result<Option<&'v Vec<Value>>, UpstreamError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(a)) if a.is_empty() => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a)),
        Some(other) => Err(not_a(at, other, "an array")),
    }
}

/// The fields of one call or fragment, each of its JSON type or absent.
struct Fragment<'v> {
    id: Option<&'v str>,
    kind: Option<&'v str>,
    name: Option<&'v str>,
    arguments: Option<String>,
}

fn fragment<'v>(call: &'v Value, at: &str) -> Result<Fragment<'v>, UpstreamError> {
    let Value::Object(o) = call else {
        return Err(not_a(at, call, "an object"));
    };
    let (name, arguments) = match o.get("function") {
        None | Some(Value::Null) => (None, None),
        Some(Value::Object(f)) => {
            let at = format!("{at}.function");
            let arguments = match f.get("arguments") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.clone()),
                Some(Value::Object(args)) => Some(Value::Object(args.clone()).to_string()),
                Some(other) => return Err(not_a(&format!("{at}.arguments"), other, "a string")),
            };
            (string(f, "name", &at)?, arguments)
        }
        Some(other) => return Err(not_a(&format!("{at}.function"), other, "an object")),
    };
    Ok(Fragment {
        id: string(o, "id", at)?,
        kind: string(o, "type", at)?,
        name,
        arguments,
    })
}

/// `o[key]` when a string; absent or `null` is `None`; another type is malformed.
fn string<'v>(
    o: &'v Map<String, Value>,
    key: &str,
    at: &str,
) -> Result<Option<&'v str>, UpstreamError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(not_a(&format!("{at}.{key}"), other, "a string")),
    }
}

/// The error for a field of the wrong type, naming it and showing (the start of) it.
fn not_a(at: &str, v: &Value, want: &str) -> UpstreamError {
    let mut shown = v.to_string();
    if shown.len() > 80 {
        let mut cut = 77;
        while !shown.is_char_boundary(cut) {
            cut -= 1;
        }
        shown.truncate(cut);
        shown.push_str("...");
    }
    UpstreamError::Malformed(format!("`{at}` is {shown}, not {want}"))
}

/// One call in the shape stored.
fn shaped(id: Option<&str>, kind: Option<&str>, name: &str, arguments: String) -> Value {
    serde_json::json!({
        "id": id,
        "type": kind.unwrap_or("function"),
        "function": {"name": name, "arguments": arguments},
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A whole answer's calls come out in the one shape: ids kept, a missing type is
    /// `function`, object arguments become their JSON text; `null`, absent and `[]` are
    /// no calls.
    #[test]
    fn whole_calls_are_read_into_the_one_shape() {
        let v = json!([
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
            {"function": {"name": "now", "arguments": {"tz": "UTC"}}},
        ]);
        let got = whole(Some(&v), "message.tool_calls").unwrap().unwrap();
        assert_eq!(
            got,
            json!([
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
                {"id": null, "type": "function", "function": {"name": "now", "arguments": "{\"tz\":\"UTC\"}"}},
            ])
        );
        for none in [None, Some(&Value::Null), Some(&json!([]))] {
            assert_eq!(whole(none, "message.tool_calls").unwrap(), None);
        }
    }

    /// Two calls streamed interleaved by `index` (ids and names on first appearance,
    /// arguments in pieces, the second call's first fragment before the first call's
    /// last) come out whole, in index order.
    #[test]
    fn streamed_fragments_are_assembled_by_index() {
        let mut a = Assembler::default();
        let events = [
            json!([{"index": 1, "id": "call_b", "type": "function", "function": {"name": "b", "arguments": ""}}]),
            json!([{"index": 0, "id": "call_a", "type": "function", "function": {"name": "a", "arguments": "{\"x\""}}]),
            json!([{"index": 1, "function": {"arguments": "{\"y\":"}}, {"index": 0, "function": {"arguments": ":1"}}]),
            json!([{"index": 0, "function": {"arguments": "}"}}]),
            json!([{"index": 1, "function": {"arguments": "2}"}}]),
        ];
        for e in &events {
            assert!(a.push(Some(e), "delta.tool_calls").unwrap());
        }
        assert!(!a.push(None, "delta.tool_calls").unwrap());
        assert!(a.retained() >= "{\"x\":1}{\"y\":2}".len() + 2 * CALL_OVERHEAD);
        assert_eq!(
            a.finish().unwrap().unwrap(),
            json!([
                {"id": "call_a", "type": "function", "function": {"name": "a", "arguments": "{\"x\":1}"}},
                {"id": "call_b", "type": "function", "function": {"name": "b", "arguments": "{\"y\":2}"}},
            ])
        );
        assert_eq!(Assembler::default().finish().unwrap(), None);
    }

    /// A name or id repeated on every fragment (some servers do) is kept once.
    #[test]
    fn repeated_names_and_ids_are_not_doubled() {
        let mut a = Assembler::default();
        for piece in ["{\"q\":", "\"x\"}"] {
            let e = json!([{"index": 0, "id": "c", "function": {"name": "search", "arguments": piece}}]);
            a.push(Some(&e), "delta.tool_calls").unwrap();
        }
        assert_eq!(
            a.finish().unwrap().unwrap(),
            json!([{"id": "c", "type": "function", "function": {"name": "search", "arguments": "{\"q\":\"x\"}"}}])
        );
    }

    /// A field of the wrong type is malformed, the message naming its path; so is a call
    /// that never names its function.
    #[test]
    fn wrong_types_are_refused_naming_the_field() {
        let cases = [
            (json!({"a": 1}), "message.tool_calls"),
            (json!([5]), "message.tool_calls[0]"),
            (
                json!([{"id": 5, "function": {"name": "f"}}]),
                "message.tool_calls[0].id",
            ),
            (
                json!([{"type": [], "function": {"name": "f"}}]),
                "message.tool_calls[0].type",
            ),
            (json!([{"function": "f"}]), "message.tool_calls[0].function"),
            (
                json!([{"function": {"name": 5}}]),
                "message.tool_calls[0].function.name",
            ),
            (
                json!([{"function": {"name": "f"}}, {"function": {"name": "g", "arguments": 5}}]),
                "message.tool_calls[1].function.arguments",
            ),
            (
                json!([{"id": "c", "function": {"arguments": "{}"}}]),
                "message.tool_calls[0].function",
            ),
        ];
        for (v, field) in cases {
            let e = whole(Some(&v), "message.tool_calls").unwrap_err();
            assert!(
                matches!(&e, UpstreamError::Malformed(m) if m.contains(&format!("`{field}`")))
                    && e.is_retriable(),
                "{v}: {e}"
            );
        }
        let mut a = Assembler::default();
        for (v, field) in [
            (json!([{"index": -1}]), "delta.tool_calls[0].index"),
            (
                json!([{"index": 4294967296u64}]),
                "delta.tool_calls[0].index",
            ),
            (json!([{"index": "0"}]), "delta.tool_calls[0].index"),
            (
                json!([{"index": 0, "function": {"arguments": 7}}]),
                "delta.tool_calls[0].function.arguments",
            ),
        ] {
            let e = a.push(Some(&v), "delta.tool_calls").unwrap_err();
            assert!(
                matches!(&e, UpstreamError::Malformed(m) if m.contains(&format!("`{field}`"))),
                "{v}: {e}"
            );
        }
        let mut a = Assembler::default();
        a.push(
            Some(&json!([{"index": 3, "function": {"arguments": "{}"}}])),
            "d",
        )
        .unwrap();
        let e = a.finish().unwrap_err();
        assert!(
            matches!(&e, UpstreamError::Malformed(m) if m.contains("tool call 3") && m.contains("function.name")),
            "{e}"
        );
    }

    proptest::proptest! {
        /// Two calls' arguments cut into fragments anywhere (on char boundaries) and
        /// interleaved in any order assemble to the arguments whole, in index order.
        #[test]
        fn any_fragmenting_assembles_the_arguments_whole(
            args in proptest::collection::vec("\\PC{0,40}", 2..=2),
            cuts in proptest::collection::vec(proptest::collection::vec(0usize..64, 0..6), 2..=2),
            order in proptest::collection::vec(proptest::bool::ANY, 0..16),
        ) {
            let pieces: Vec<Vec<String>> = args
                .iter()
                .zip(&cuts)
                .map(|(a, cut)| {
                    let chars: Vec<char> = a.chars().collect();
                    let mut at: Vec<usize> = cut.iter().map(|c| c % (chars.len() + 1)).collect();
                    at.push(0);
                    at.push(chars.len());
                    at.sort_unstable();
                    at.windows(2).map(|w| chars[w[0]..w[1]].iter().collect()).collect()
                })
                .collect();
            let mut a = Assembler::default();
            for (i, name) in ["f", "g"].iter().enumerate() {
                let e = json!([{"index": i, "id": format!("c{i}"), "function": {"name": name}}]);
                a.push(Some(&e), "d").unwrap();
            }
            let mut next = [0usize; 2];
            let mut turn = order.iter().copied().cycle();
            while next[0] < pieces[0].len() || next[1] < pieces[1].len() {
                let i = usize::from(turn.next().unwrap_or(false));
                let i = if next[i] < pieces[i].len() { i } else { 1 - i };
                let e = json!([{"index": i, "function": {"arguments": pieces[i][next[i]]}}]);
                a.push(Some(&e), "d").unwrap();
                next[i] += 1;
            }
            let got = a.finish().unwrap().unwrap();
            proptest::prop_assert_eq!(got[0]["function"]["arguments"].as_str(), Some(args[0].as_str()));
            proptest::prop_assert_eq!(got[1]["function"]["arguments"].as_str(), Some(args[1].as_str()));
            proptest::prop_assert_eq!(got[1]["function"]["name"].as_str(), Some("g"));
        }

        /// Arbitrary JSON trees built of the fields read (and others) as `tool_calls`,
        /// whole or streamed: each gives either calls all in the one shape (a non-empty
        /// name, string arguments, an id string or null) or a malformed answer.
        #[test]
        fn arbitrary_trees_give_the_shape_or_malformed(v in tree()) {
            let shaped_ok = |r: Result<Option<Value>, UpstreamError>| -> Result<(), String> {
                match r {
                    Ok(None) => Ok(()),
                    Ok(Some(Value::Array(calls))) if !calls.is_empty() => {
                        for c in &calls {
                            let f = &c["function"];
                            let good = f["name"].as_str().is_some_and(|n| !n.is_empty())
                                && f["arguments"].is_string()
                                && c["type"].is_string()
                                && (c["id"].is_string() || c["id"].is_null());
                            if !good {
                                return Err(format!("not the shape: {c}"));
                            }
                        }
                        Ok(())
                    }
                    Ok(Some(other)) => Err(format!("not an array of calls: {other}")),
                    Err(UpstreamError::Malformed(_)) => Ok(()),
                    Err(e) => Err(format!("not malformed: {e}")),
                }
            };
            proptest::prop_assert_eq!(shaped_ok(whole(Some(&v), "m")), Ok(()));
            let mut a = Assembler::default();
            let pushed = a.push(Some(&v), "d");
            if pushed.is_ok() {
                proptest::prop_assert_eq!(shaped_ok(a.finish()), Ok(()));
            } else {
                proptest::prop_assert!(matches!(pushed, Err(UpstreamError::Malformed(_))));
            }
        }
    }

    /// JSON trees whose keys are mostly the ones a call has.
    fn tree() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            (0u64..4).prop_map(Value::from),
            "[a-z{}\":]{0,6}".prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 48, 5, |inner| {
            let key = prop_oneof![
                Just("index"),
                Just("id"),
                Just("type"),
                Just("function"),
                Just("name"),
                Just("arguments"),
                Just("x"),
            ];
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..5).prop_map(Value::from),
                proptest::collection::vec((key, inner), 0..5).prop_map(|kv| {
                    Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
                }),
            ]
        })
    }

    /// Far-apart indexes (a hostile stream) cost a map entry each, not a vector up to the
    /// largest index, and every entry is counted in what is retained.
    #[test]
    fn far_apart_indexes_hold_only_their_calls() {
        let mut a = Assembler::default();
        for i in [0u32, 1 << 20, u32::MAX] {
            let e = json!([{"index": i, "function": {"name": "f", "arguments": ""}}]);
            a.push(Some(&e), "d").unwrap();
        }
        assert_eq!(a.calls.len(), 3);
        assert_eq!(a.retained(), 3 * (CALL_OVERHEAD + 1));
        let calls = a.finish().unwrap().unwrap();
        assert_eq!(calls.as_array().map(Vec::len), Some(3));
    }
}
