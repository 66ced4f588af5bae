//! A model family's reasoning and tool-call syntax in raw completions (`/generate`,
//! `/v1/completions`), split as SGLang's `--reasoning-parser` and `--tool-call-parser`
//! split a chat reply: Kimi K2 ([`kimi`]), DeepSeek V3.1 / V3.2 ([`deepseek`]), GLM-4.5
//! ([`glm`]), MiniMax-M2 ([`minimax`]), Qwen3-Coder ([`qwen3_coder`]), gpt-oss
//! ([`harmony`]); Qwen3 and other `<think>` / Hermes templates keep spool's own split
//! ([`crate::prompt::reasoning`], [`crate::prompt::tool_text`]).
//!
//! Invariants: the syntax is chosen once per run, from the chat template's source (its
//! markers) unless `[tokenizer] reasoning_parser` / `tool_parser` name one; a reply is
//! split into exactly what SGLang's parsers of that name return (goldens in
//! `tests/fixtures/parsers/` pin it); the token ids are never touched. Calls come out in
//! OpenAI's `tool_calls` shape, `arguments` a JSON string.

pub mod deepseek;
pub mod glm;
pub mod harmony;
pub mod kimi;
pub mod minimax;
pub mod qwen3_coder;
pub mod think;
pub mod values;

use super::reasoning::ThinkMarkers;
use super::tool_text::ToolCallSyntax;
use serde_json::{json, Map, Value};
use think::ThinkBlock;

/// One call a parser took out of the text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    /// The id the model wrote (Kimi's `functions.NAME:IDX`), if the syntax carries one.
    pub id: Option<String>,
    pub name: String,
    /// JSON text.
    pub arguments: String,
}

/// How thinking is taken out of a raw completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reasoning {
    /// spool's marker split (Qwen3, DeepSeek-R1, `◁think▷`): newlines trimmed as Qwen3's
    /// template trims them on re-rendering.
    Markers(ThinkMarkers),
    /// SGLang's `kimi_k2`.
    KimiK2,
    /// SGLang's `deepseek-v3` (DeepSeek V3.1 / V3.2 thinking mode).
    DeepSeekV3,
    /// SGLang's `glm45`.
    Glm45,
    /// SGLang's `minimax`: thinking from the start of the reply.
    MiniMax,
    /// SGLang's `minimax-append-think`: nothing split, `<think>` put back in front.
    MiniMaxAppendThink,
    /// SGLang's `gpt-oss`: the harmony `analysis` channel.
    GptOss,
}

/// How tool calls are taken out of a raw completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tools {
    /// spool's Hermes split (`<tool_call>{json}</tool_call>`, Qwen2.5 / Qwen3).
    Hermes,
    KimiK2,
    DeepSeekV31,
    DeepSeekV32,
    Glm45,
    MiniMaxM2,
    Qwen3Coder,
    GptOss,
}

/// The names `[tokenizer] reasoning_parser` takes (SGLang's `--reasoning-parser`).
pub const REASONING_PARSERS: &[&str] = &[
    "deepseek-r1",
    "deepseek-v3",
    "glm45",
    "gpt-oss",
    "kimi",
    "kimi_k2",
    "minimax",
    "minimax-append-think",
    "qwen3",
    "qwen3-thinking",
];

/// The names `[tokenizer] tool_parser` takes (SGLang's `--tool-call-parser`).
pub const TOOL_PARSERS: &[&str] = &[
    "deepseekv31",
    "deepseekv32",
    "glm",
    "glm45",
    "gpt-oss",
    "hermes",
    "kimi_k2",
    "minimax-m2",
    "qwen",
    "qwen25",
    "qwen3_coder",
];

impl Reasoning {
    /// The parser SGLang names `name`, if it is one of [`REASONING_PARSERS`].
    pub fn named(name: &str) -> Option<Reasoning> {
        let think = |open: &str, close: &str| {
            Reasoning::Markers(ThinkMarkers {
                open: open.into(),
                close: close.into(),
            })
        };
        Some(match name {
            "deepseek-r1" | "qwen3" | "qwen3-thinking" => think("<think>", "</think>"),
            "kimi" => think("◁think▷", "◁/think▷"),
            "kimi_k2" => Reasoning::KimiK2,
            "deepseek-v3" => Reasoning::DeepSeekV3,
            "glm45" => Reasoning::Glm45,
            "minimax" => Reasoning::MiniMax,
            "minimax-append-think" => Reasoning::MiniMaxAppendThink,
            "gpt-oss" => Reasoning::GptOss,
            _ => return None,
        })
    }

    /// Its name in logs.
    pub fn name(&self) -> &'static str {
        match self {
            Reasoning::Markers(m) if m.open == "◁think▷" => "kimi",
            Reasoning::Markers(_) => "qwen3",
            Reasoning::KimiK2 => "kimi_k2",
            Reasoning::DeepSeekV3 => "deepseek-v3",
            Reasoning::Glm45 => "glm45",
            Reasoning::MiniMax => "minimax",
            Reasoning::MiniMaxAppendThink => "minimax-append-think",
            Reasoning::GptOss => "gpt-oss",
        }
    }

    /// The SGLang detector's markers (for the parsers built on its base detector).
    fn block(&self) -> Option<ThinkBlock> {
        let b = |tool_start, always_forced| ThinkBlock {
            open: "<think>",
            close: "</think>",
            tool_start,
            always_forced,
        };
        Some(match self {
            Reasoning::KimiK2 => b(Some(kimi::SECTION_BEGIN), false),
            Reasoning::DeepSeekV3 => b(Some("<tool_call>"), false),
            Reasoning::Glm45 => b(Some("<tool_call>"), false),
            Reasoning::MiniMax => b(Some("<tool_call>"), true),
            _ => return None,
        })
    }

    /// Whether the reply starts inside its thinking block, as SGLang's chat server decides
    /// (`force_reasoning`): when the prompt ends by opening the block, and otherwise by the
    /// parser's default and the request's thinking switch — Kimi K2 and GLM-4.5 think unless
    /// `thinking` / `enable_thinking` is `false`, DeepSeek V3 only when `thinking` is `true`,
    /// MiniMax always.
    fn forced(&self, open: &str, prompt: &str, kwargs: &Map<String, Value>) -> bool {
        let off = |k: &str| kwargs.get(k) == Some(&Value::Bool(false));
        prompt.trim_end().ends_with(open)
            || match self {
                Reasoning::KimiK2 => !off("thinking"),
                Reasoning::Glm45 => !off("enable_thinking"),
                Reasoning::DeepSeekV3 => kwargs.get("thinking") == Some(&Value::Bool(true)),
                _ => false,
            }
    }

    /// (reasoning, answer) of a raw completion generated after `prompt` with the template
    /// variables `kwargs`; reasoning `None` when there is none.
    pub fn split(
        &self,
        text: &str,
        prompt: &str,
        kwargs: &Map<String, Value>,
    ) -> (Option<String>, String) {
        match self {
            Reasoning::Markers(m) => m.split(text),
            Reasoning::GptOss => harmony::split_reasoning(text),
            Reasoning::MiniMaxAppendThink => (None, format!("<think>{text}")),
            other => {
                let Some(block) = other.block() else {
                    return (None, text.to_owned());
                };
                let (r, a) = block.split(text, other.forced(block.open, prompt, kwargs));
                (r.filter(|r| !r.is_empty()), a)
            }
        }
    }
}

impl Tools {
    /// The parser SGLang names `name`, if it is one of [`TOOL_PARSERS`].
    pub fn named(name: &str) -> Option<Tools> {
        Some(match name {
            "hermes" | "qwen" | "qwen25" => Tools::Hermes,
            "kimi_k2" => Tools::KimiK2,
            "deepseekv31" => Tools::DeepSeekV31,
            "deepseekv32" => Tools::DeepSeekV32,
            "glm" | "glm45" => Tools::Glm45,
            "minimax-m2" => Tools::MiniMaxM2,
            "qwen3_coder" => Tools::Qwen3Coder,
            "gpt-oss" => Tools::GptOss,
            _ => return None,
        })
    }

    /// Its name in logs.
    pub fn name(&self) -> &'static str {
        match self {
            Tools::Hermes => "hermes",
            Tools::KimiK2 => "kimi_k2",
            Tools::DeepSeekV31 => "deepseekv31",
            Tools::DeepSeekV32 => "deepseekv32",
            Tools::Glm45 => "glm45",
            Tools::MiniMaxM2 => "minimax-m2",
            Tools::Qwen3Coder => "qwen3_coder",
            Tools::GptOss => "gpt-oss",
        }
    }

    /// (answer, calls) as SGLang's `FunctionCallParser.parse_non_stream` gives them:
    /// `None` when the text has no call marker (the text stays the answer).
    pub fn parse(&self, text: &str, tools: &[Value]) -> Option<(String, Vec<ParsedCall>)> {
        match self {
            Tools::Hermes => None,
            Tools::KimiK2 => kimi::split_calls(text, tools),
            Tools::DeepSeekV31 => deepseek::split_v31(text, tools),
            Tools::DeepSeekV32 => deepseek::split_v32(text, tools),
            Tools::Glm45 => glm::split_calls(text, tools),
            Tools::MiniMaxM2 => minimax::split_calls(text, tools),
            Tools::Qwen3Coder => qwen3_coder::split_calls(text, tools),
            Tools::GptOss => harmony::split_calls(text, tools).map(|(a, calls)| {
                (
                    a,
                    calls
                        .into_iter()
                        .map(|(name, arguments)| ParsedCall {
                            id: None,
                            name,
                            arguments,
                        })
                        .collect(),
                )
            }),
        }
    }

    /// (answer, OpenAI `tool_calls`) of a raw answer; `(text, None)` when it makes no call.
    /// Ids: the model's own where the syntax has one (Kimi), else `call_<xxh64>` of the
    /// call's place and the raw text (stable across reads, unique within the reply).
    pub fn split(&self, text: &str, tools: &[Value]) -> (String, Option<Value>) {
        if *self == Tools::Hermes {
            return ToolCallSyntax.split(text);
        }
        let Some((answer, calls)) = self.parse(text, tools) else {
            return (text.to_owned(), None);
        };
        if calls.is_empty() {
            return (answer, None);
        }
        let calls = calls
            .into_iter()
            .enumerate()
            .map(|(k, c)| {
                let id = c.id.unwrap_or_else(|| {
                    let h = twox_hash::XxHash64::oneshot(k as u64, text.as_bytes());
                    format!("call_{h:016x}")
                });
                json!({"id": id, "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}})
            })
            .collect();
        (answer, Some(Value::Array(calls)))
    }
}

/// `messages` as SGLang's and vLLM's chat servers hand them to a template: an assistant
/// tool call's `arguments` text that is a JSON object becomes that object (the servers
/// parse it before rendering; templates such as GLM's and Qwen3-Coder's iterate it, and
/// `tojson` writes it back as Python does). `None` when nothing changes.
pub fn arguments_as_objects(messages: &Value) -> Option<Value> {
    let needs = |m: &Value| {
        m.get("role").and_then(Value::as_str) == Some("assistant")
            && m.get("tool_calls")
                .and_then(Value::as_array)
                .is_some_and(|calls| calls.iter().any(|c| object_text(c).is_some()))
    };
    if !messages.as_array()?.iter().any(needs) {
        return None;
    }
    let mut out = messages.clone();
    for m in out.as_array_mut()?.iter_mut().filter(|m| needs(m)) {
        for call in m["tool_calls"].as_array_mut().into_iter().flatten() {
            if let Some(obj) = object_text(call) {
                call["function"]["arguments"] = obj;
            }
        }
    }
    Some(out)
}

/// The object a call's `function.arguments` text encodes, if it is one.
fn object_text(call: &Value) -> Option<Value> {
    let text = call.get("function")?.get("arguments")?.as_str()?;
    values::loads(text).filter(Value::is_object)
}

/// The model families whose end of turn exports know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Kimi,
    DeepSeek,
    Glm,
    MiniMax,
    GptOss,
    Qwen,
}

impl Family {
    /// The token that closes an assistant turn (the model's stop token), and the one after
    /// a turn that ends in tool calls where it differs.
    pub fn end_of_turn(&self) -> (&'static str, Option<&'static str>) {
        match self {
            Family::Kimi | Family::Qwen => ("<|im_end|>", None),
            Family::DeepSeek => ("<｜end▁of▁sentence｜>", None),
            Family::Glm => ("<|user|>", Some("<|observation|>")),
            Family::MiniMax => ("[e~[", None),
            Family::GptOss => ("<|return|>", Some("<|call|>")),
        }
    }

    /// Its name in logs and metadata.
    pub fn name(&self) -> &'static str {
        match self {
            Family::Kimi => "kimi",
            Family::DeepSeek => "deepseek",
            Family::Glm => "glm",
            Family::MiniMax => "minimax",
            Family::GptOss => "gpt-oss",
            Family::Qwen => "qwen",
        }
    }
}

/// A run's syntax: how its raw completions are split, and why.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Syntax {
    pub reasoning: Option<Reasoning>,
    pub tools: Option<Tools>,
    /// Where the choice came from (logged at start).
    pub why: String,
}

/// Template markers that name a family, tried in order (SGLang's template detection
/// rules, reduced to the text of the template).
/// (family, markers that must all be in the template, reasoning parser, tool parser).
type Rule = (
    &'static str,
    &'static [&'static str],
    Option<&'static str>,
    Option<&'static str>,
);

const DETECTION: &[Rule] = &[
    (
        "gpt-oss",
        &["<|channel|>"],
        Some("gpt-oss"),
        Some("gpt-oss"),
    ),
    (
        "kimi_k2",
        &["<|tool_calls_section_begin|>"],
        Some("kimi_k2"),
        Some("kimi_k2"),
    ),
    (
        "minimax",
        &["<minimax:tool_call>"],
        Some("minimax"),
        Some("minimax-m2"),
    ),
    (
        "deepseek_v32",
        &["<｜DSML｜function_calls>"],
        Some("deepseek-v3"),
        Some("deepseekv32"),
    ),
    // Templates that build the tags from a `dsml_token` variable (llama.cpp's V3.2).
    (
        "deepseek_v32",
        &["｜DSML｜", "function_calls>"],
        Some("deepseek-v3"),
        Some("deepseekv32"),
    ),
    (
        "deepseek_v31",
        &["<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>"],
        Some("deepseek-v3"),
        Some("deepseekv31"),
    ),
    (
        "glm45",
        &["<arg_key>", "<arg_value>"],
        Some("glm45"),
        Some("glm45"),
    ),
    (
        "qwen3_coder",
        &["<function=", "<parameter="],
        None,
        Some("qwen3_coder"),
    ),
];

impl Syntax {
    /// The syntax a chat template's source teaches its model. A template of none of the
    /// families keeps spool's own splits: think markers and Hermes calls when it has them.
    pub fn of_template(source: &str) -> Syntax {
        for (family, markers, reasoning, tools) in DETECTION {
            if markers.iter().all(|m| source.contains(m)) {
                let mut reasoning = reasoning.and_then(Reasoning::named);
                // Kimi K2 Instruct does not think: its parser would call the whole reply
                // reasoning.
                if *family == "kimi_k2" && !source.contains("<think>") {
                    reasoning = None;
                }
                if reasoning.is_none() {
                    reasoning = ThinkMarkers::of_source(source).map(Reasoning::Markers);
                }
                let shown: Vec<String> = markers.iter().map(|m| format!("`{m}`")).collect();
                return Syntax {
                    reasoning,
                    tools: tools.and_then(Tools::named),
                    why: format!("the chat template has {} ({family})", shown.join(" and ")),
                };
            }
        }
        let reasoning = ThinkMarkers::of_source(source).map(Reasoning::Markers);
        let tools = ToolCallSyntax::of_source(source).map(|_| Tools::Hermes);
        let why = if reasoning.is_some() || tools.is_some() {
            "the chat template's think markers / `<tool_call>` (spool's Qwen3 split)"
        } else {
            "the chat template has no known reasoning or tool-call markers"
        };
        Syntax {
            reasoning,
            tools,
            why: why.into(),
        }
    }

    /// This syntax with the parsers the config names in place of the detected ones
    /// (names already checked against [`REASONING_PARSERS`] / [`TOOL_PARSERS`]).
    pub fn overridden(mut self, reasoning: Option<&str>, tools: Option<&str>) -> Syntax {
        if let Some(r) = reasoning.and_then(Reasoning::named) {
            self.reasoning = Some(r);
            self.why = format!("{}; reasoning_parser from the config", self.why);
        }
        if let Some(t) = tools.and_then(Tools::named) {
            self.tools = Some(t);
            self.why = format!("{}; tool_parser from the config", self.why);
        }
        self
    }

    /// The family whose end of turn exports append.
    pub fn family(&self) -> Option<Family> {
        match (self.tools, &self.reasoning) {
            (Some(Tools::KimiK2), _) | (_, Some(Reasoning::KimiK2)) => Some(Family::Kimi),
            (Some(Tools::DeepSeekV31 | Tools::DeepSeekV32), _)
            | (_, Some(Reasoning::DeepSeekV3)) => Some(Family::DeepSeek),
            (Some(Tools::Glm45), _) | (_, Some(Reasoning::Glm45)) => Some(Family::Glm),
            (Some(Tools::MiniMaxM2), _)
            | (_, Some(Reasoning::MiniMax | Reasoning::MiniMaxAppendThink)) => {
                Some(Family::MiniMax)
            }
            (Some(Tools::GptOss), _) | (_, Some(Reasoning::GptOss)) => Some(Family::GptOss),
            (Some(Tools::Qwen3Coder | Tools::Hermes), _) => Some(Family::Qwen),
            _ => None,
        }
    }

    /// Whether the split reads the text of the completion's ids (special tokens kept, the
    /// stop token dropped) rather than the server's text: these families' markers are
    /// special tokens a server's default decoding removes, as SGLang's chat server keeps
    /// them for its parsers.
    pub fn reads_token_text(&self) -> bool {
        let spools_own = matches!(self.reasoning, None | Some(Reasoning::Markers(_)))
            && matches!(self.tools, None | Some(Tools::Hermes));
        !spools_own
    }

    /// One line for the start-up log.
    pub fn describe(&self) -> String {
        format!(
            "reasoning parser {}, tool parser {} ({})",
            self.reasoning.as_ref().map_or("none", Reasoning::name),
            self.tools.as_ref().map_or("none", Tools::name),
            self.why
        )
    }
}

#[cfg(test)]
mod tests;
