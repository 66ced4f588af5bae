//! On-policy conversations: turn k of a conversation is requested after the *generated*
//! replies of turns 0..k, never the source's own assistant turns.
//!
//! Invariant: a request for turn k holds the source's system prompt, its user turns up to
//! k, the k replies generated before it and the tool results cached in the source that
//! follow a generated tool call matching them (by order and name); at the first mismatch
//! the conversation stops, with the reason.

use crate::config::HistoryReasoning;
use serde_json::{Map, Value};

/// One generated assistant reply, as later turns' histories hold it.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    pub content: String,
    pub reasoning: Option<String>,
    /// OpenAI `tool_calls` array.
    pub tool_calls: Option<Value>,
}

/// The assistant replies in `messages`: the place in its conversation of the turn
/// generated after them (0 for a single-turn prompt).
pub fn replies_before(messages: Option<&Value>) -> u32 {
    messages.and_then(Value::as_array).map_or(0, |m| {
        m.iter().filter(|x| role(x) == "assistant").count() as u32
    })
}

/// A source conversation with every message kept (assistant turns included), as a
/// `turns = "all"` item stores it.
#[derive(Debug, Clone)]
pub struct Conversation {
    messages: Vec<Value>,
}

fn role(m: &Value) -> &str {
    m.get("role").and_then(Value::as_str).unwrap_or("")
}

/// The function name of an OpenAI tool call (`{"function": {"name": ..}}`, or a bare
/// `{"name": ..}`).
fn call_name(call: &Value) -> Option<&str> {
    call.get("function")
        .unwrap_or(call)
        .get("name")
        .and_then(Value::as_str)
}

fn calls_of(v: Option<&Value>) -> &[Value] {
    v.and_then(Value::as_array).map_or(&[][..], Vec::as_slice)
}

impl Conversation {
    /// The conversation of an item's stored messages.
    pub fn new(messages: Vec<Value>) -> Conversation {
        Conversation { messages }
    }

    /// Indices of the source's assistant messages, in order.
    fn assistants(&self) -> Vec<usize> {
        (0..self.messages.len())
            .filter(|&i| role(&self.messages[i]) == "assistant")
            .collect()
    }

    /// How many assistant turns are generated: one per assistant message, and one more
    /// when the conversation ends with a user (or tool) message.
    pub fn turns(&self) -> u32 {
        let assistants = self.assistants().len() as u32;
        match self.messages.last().map(role) {
            Some("user" | "tool") => assistants + 1,
            _ => assistants,
        }
    }

    /// Turn `k`'s request messages, given the `k` replies generated before it; `Err` says
    /// why the conversation stops before turn `k` (a tool call that does not match the
    /// cached result).
    pub fn request(
        &self,
        k: u32,
        earlier: &[Reply],
        history: HistoryReasoning,
    ) -> Result<Vec<Value>, String> {
        let turns = self.turns();
        if k >= turns {
            return Err(format!("no turn {k}: the conversation has {turns}"));
        }
        let k = k as usize;
        if earlier.len() < k {
            return Err(format!(
                "turn {k} needs {k} earlier replies, {} given",
                earlier.len()
            ));
        }
        let assistants = self.assistants();
        // Turn k is requested after everything before the k-th assistant message (the
        // whole conversation for a final turn after a user or tool message).
        let end = assistants.get(k).copied().unwrap_or(self.messages.len());
        let mut out = Vec::with_capacity(end);
        let mut i = 0;
        let mut j = 0;
        while i < end {
            let m = &self.messages[i];
            if role(m) != "assistant" {
                out.push(m.clone());
                i += 1;
                continue;
            }
            let reply = &earlier[j];
            out.push(reply_message(reply, history));
            // The tool results cached right after source assistant j.
            let first = i + 1;
            let mut last = first;
            while last < end && role(&self.messages[last]) == "tool" {
                last += 1;
            }
            let results = &self.messages[first..last];
            let generated = calls_of(reply.tool_calls.as_ref());
            let source_calls = calls_of(m.get("tool_calls"));
            if generated.len() != results.len() {
                let next = self.messages.get(last).map(role).unwrap_or("nothing");
                return Err(match (generated.len(), results.len()) {
                    (n, 0) => format!(
                        "tool_mismatch: turn {j}: the reply made {n} tool call(s), the source \
                         follows with {next}, not a tool result"
                    ),
                    (0, r) => format!(
                        "tool_mismatch: turn {j}: the reply made no tool call, the source \
                         follows with {r} tool result(s)"
                    ),
                    (n, r) => format!(
                        "tool_mismatch: turn {j}: the reply made {n} tool call(s), the source \
                         has {r} tool result(s)"
                    ),
                });
            }
            for (c, (call, result)) in generated.iter().zip(results).enumerate() {
                let want = result_name(result, source_calls, c);
                let got = call_name(call);
                if want.is_none() || got != want {
                    return Err(format!(
                        "tool_mismatch: turn {j}: call {c} is `{}`, the cached result {c} is \
                         for `{}`",
                        got.unwrap_or("?"),
                        want.unwrap_or("?")
                    ));
                }
                let mut result = result.clone();
                if let Some(o) = result.as_object_mut() {
                    match call.get("id") {
                        Some(id @ Value::String(_)) => {
                            o.insert("tool_call_id".into(), id.clone());
                        }
                        _ => {
                            o.remove("tool_call_id");
                        }
                    }
                }
                out.push(result);
            }
            i = last;
            j += 1;
        }
        Ok(out)
    }
}

/// The function a cached tool result answers: the source call its `tool_call_id` names,
/// else its own `name`, else the source's call at the same position.
fn result_name<'a>(result: &'a Value, source_calls: &'a [Value], at: usize) -> Option<&'a str> {
    if let Some(id) = result.get("tool_call_id").and_then(Value::as_str) {
        if let Some(call) = source_calls
            .iter()
            .find(|c| c.get("id").and_then(Value::as_str) == Some(id))
        {
            return call_name(call);
        }
    }
    if let Some(name) = result.get("name").and_then(Value::as_str) {
        return Some(name);
    }
    source_calls.get(at).and_then(call_name)
}

/// A generated reply as an assistant message of a later turn's history.
fn reply_message(reply: &Reply, history: HistoryReasoning) -> Value {
    let mut m = Map::new();
    m.insert("role".into(), Value::from("assistant"));
    m.insert("content".into(), Value::from(reply.content.as_str()));
    if history == HistoryReasoning::Keep {
        if let Some(r) = &reply.reasoning {
            m.insert("reasoning_content".into(), Value::from(r.as_str()));
        }
    }
    if let Some(calls) = &reply.tool_calls {
        if !calls_of(Some(calls)).is_empty() {
            m.insert("tool_calls".into(), calls.clone());
        }
    }
    Value::Object(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn reply(content: &str) -> Reply {
        Reply {
            content: content.into(),
            reasoning: Some(format!("thought about {content}")),
            tool_calls: None,
        }
    }

    fn call(id: &str, name: &str) -> Value {
        json!({"id": id, "type": "function", "function": {"name": name, "arguments": "{}"}})
    }

    /// A single-turn prompt's reply is turn 0; after two assistant replies it is turn 2.
    #[test]
    fn the_turn_after_messages_counts_their_replies() {
        let m = json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"}]);
        assert_eq!(replies_before(Some(&m)), 2);
        assert_eq!(
            replies_before(Some(&json!([{"role": "user", "content": "a"}]))),
            0
        );
        assert_eq!(replies_before(None), 0);
    }

    fn three_turns() -> Conversation {
        Conversation::new(
            json!([
                {"role": "system", "content": "S"},
                {"role": "user", "content": "U0"},
                {"role": "assistant", "content": "ORIGINAL0"},
                {"role": "user", "content": "U1"},
                {"role": "assistant", "content": "ORIGINAL1"},
                {"role": "user", "content": "U2"},
                {"role": "assistant", "content": "ORIGINAL2"},
            ])
            .as_array()
            .unwrap()
            .clone(),
        )
    }

    /// A 3-turn conversation: each turn's request holds the system prompt, the user turns
    /// up to it and the generated replies before it, never the source's own replies;
    /// reasoning goes back only with `history_reasoning = "keep"`.
    #[test]
    fn histories_carry_generated_replies_never_originals() {
        let c = three_turns();
        assert_eq!(c.turns(), 3);
        let gen = [reply("G0"), reply("G1")];
        let r0 = c.request(0, &[], HistoryReasoning::Drop).unwrap();
        assert_eq!(
            Value::Array(r0),
            json!([{"role": "system", "content": "S"}, {"role": "user", "content": "U0"}])
        );
        let r2 = c.request(2, &gen, HistoryReasoning::Drop).unwrap();
        assert_eq!(
            Value::Array(r2.clone()),
            json!([
                {"role": "system", "content": "S"},
                {"role": "user", "content": "U0"},
                {"role": "assistant", "content": "G0"},
                {"role": "user", "content": "U1"},
                {"role": "assistant", "content": "G1"},
                {"role": "user", "content": "U2"},
            ])
        );
        assert!(!Value::Array(r2).to_string().contains("ORIGINAL"));
        let kept = c.request(1, &gen[..1], HistoryReasoning::Keep).unwrap();
        assert_eq!(kept[2]["reasoning_content"], "thought about G0");
        assert!(c.request(3, &gen, HistoryReasoning::Drop).is_err());
        assert!(c.request(2, &gen[..1], HistoryReasoning::Drop).is_err());
    }

    /// A conversation ending with a user message has one more turn, after everything.
    #[test]
    fn a_trailing_user_message_is_a_final_turn() {
        let c = Conversation::new(
            json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                   {"role": "user", "content": "c"}])
            .as_array()
            .unwrap()
            .clone(),
        );
        assert_eq!(c.turns(), 2);
        let r = c.request(1, &[reply("B")], HistoryReasoning::Drop).unwrap();
        assert_eq!(r.len(), 3);
        assert_eq!(r[1]["content"], "B");
        assert_eq!(r[2]["content"], "c");
        let none = Conversation::new(vec![json!({"role": "system", "content": "s"})]);
        assert_eq!(none.turns(), 0);
    }

    fn with_tools() -> Conversation {
        Conversation::new(
            json!([
                {"role": "user", "content": "weather and time?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "src_a", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
                    {"id": "src_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "src_a", "content": "sunny"},
                {"role": "tool", "tool_call_id": "src_b", "content": "noon"},
                {"role": "assistant", "content": "Sunny at noon."},
                {"role": "user", "content": "thanks"},
            ])
            .as_array()
            .unwrap()
            .clone(),
        )
    }

    /// The cached tool results follow the generated calls that match them by order and
    /// name, their `tool_call_id` rewritten to the generated call's id.
    #[test]
    fn tool_results_are_spliced_after_matching_calls() {
        let c = with_tools();
        assert_eq!(c.turns(), 3);
        let g0 = Reply {
            content: String::new(),
            reasoning: None,
            tool_calls: Some(json!([
                call("gen_1", "get_weather"),
                call("gen_2", "get_time")
            ])),
        };
        let r = c
            .request(2, &[g0, reply("G1")], HistoryReasoning::Drop)
            .unwrap();
        assert_eq!(r[1]["tool_calls"][0]["id"], "gen_1");
        assert_eq!(
            r[2],
            json!({"role": "tool", "tool_call_id": "gen_1", "content": "sunny"})
        );
        assert_eq!(
            r[3],
            json!({"role": "tool", "tool_call_id": "gen_2", "content": "noon"})
        );
        assert_eq!(r[4]["content"], "G1");
        assert_eq!(r[5]["content"], "thanks");
        assert_eq!(r.len(), 6);
        // Turn 1's request ends with the tool results.
        let g0 = Reply {
            content: String::new(),
            reasoning: None,
            tool_calls: Some(json!([call("x", "get_weather"), call("y", "get_time")])),
        };
        let r1 = c.request(1, &[g0], HistoryReasoning::Drop).unwrap();
        assert_eq!(r1.last().unwrap()["tool_call_id"], "y");
    }

    /// Every kind of mismatch stops the conversation with `tool_mismatch: turn j`: a
    /// wrong name, a wrong count, calls followed by a user message, no calls followed by
    /// tool results.
    #[test]
    fn each_mismatch_kind_is_refused() {
        let c = with_tools();
        let calls = |cs: Value| Reply {
            content: String::new(),
            reasoning: None,
            tool_calls: Some(cs),
        };
        let swapped = calls(json!([call("1", "get_time"), call("2", "get_weather")]));
        let one = calls(json!([call("1", "get_weather")]));
        let none = reply("no tools");
        for (bad, says) in [
            (swapped, "is `get_time`"),
            (one, "1 tool call(s), the source has 2"),
            (none, "no tool call"),
        ] {
            let e = c.request(1, &[bad], HistoryReasoning::Drop).unwrap_err();
            assert!(e.starts_with("tool_mismatch: turn 0:"), "{e}");
            assert!(e.contains(says), "{e}");
        }
        let plain = three_turns();
        let e = plain
            .request(1, &[calls(json!([call("1", "f")]))], HistoryReasoning::Drop)
            .unwrap_err();
        assert!(e.starts_with("tool_mismatch: turn 0:"), "{e}");
        assert!(e.contains("follows with user"), "{e}");
    }

    /// A tool result naming its function by `name` (no `tool_call_id`) is matched by it.
    #[test]
    fn a_result_may_name_its_function() {
        let c = Conversation::new(
            json!([
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": "ORIGINAL"},
                {"role": "tool", "name": "lookup", "content": "r"},
            ])
            .as_array()
            .unwrap()
            .clone(),
        );
        assert_eq!(c.turns(), 2);
        let g = Reply {
            content: String::new(),
            reasoning: None,
            tool_calls: Some(json!([call("g", "lookup")])),
        };
        let r = c.request(1, &[g], HistoryReasoning::Drop).unwrap();
        assert_eq!(r[2]["tool_call_id"], "g");
        let wrong = Reply {
            content: String::new(),
            reasoning: None,
            tool_calls: Some(json!([call("g", "search")])),
        };
        assert!(c.request(1, &[wrong], HistoryReasoning::Drop).is_err());
    }
}
