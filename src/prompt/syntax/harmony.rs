//! gpt-oss's harmony channels, as SGLang's `HarmonyParser` reads a whole reply (one
//! `parse(text)` and the flushing `parse("")`): `analysis` is reasoning, `final` the
//! answer, a `commentary` (or `analysis`) block ended by `<|call|>` a tool call; replies
//! without markers fall back to its text strategy (`analysis…assistantfinal…`).
//!
//! Invariant: the events, their order and their text are those SGLang's parser yields,
//! including what it holds back at the end of the text (a trailing partial marker) and
//! the `commentary` filler it drops after a call.

use super::values::{dumps, loads, offers};
use regex::Regex;
use serde_json::{Map, Value};
use std::sync::LazyLock;

/// What a stretch of the reply is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    Reasoning,
    Normal,
    ToolCall,
}

/// One parsed piece: its kind, its content, and for tool calls the raw text with markers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub kind: Kind,
    pub content: String,
    pub raw: Option<String>,
}

fn ev(kind: Kind, content: &str) -> Event {
    Event {
        kind,
        content: content.to_owned(),
        raw: None,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tok {
    Text,
    Start,
    Channel,
    Message,
    Constrain,
    End,
    Call,
    Return,
}

#[derive(Debug, Clone, Copy)]
struct Token {
    kind: Tok,
    start: usize,
    end: usize,
}

const LITERALS: [(&str, Tok); 7] = [
    ("<|start|>", Tok::Start),
    ("<|channel|>", Tok::Channel),
    ("<|message|>", Tok::Message),
    ("<|constrain|>", Tok::Constrain),
    ("<|end|>", Tok::End),
    ("<|call|>", Tok::Call),
    ("<|return|>", Tok::Return),
];

fn tk(kind: Tok, start: usize, end: usize) -> Token {
    Token { kind, start, end }
}

/// `iter_tokens`: structural tokens and the text between them.
fn tokens(text: &str) -> Vec<Token> {
    let mut out = Vec::new();
    let mut pos = 0;
    let mut unknown = false;
    while pos < text.len() {
        let Some(rel) = text[pos..].find("<|") else {
            break;
        };
        let m = pos + rel;
        if m > pos {
            out.push(tk(Tok::Text, pos, m));
        }
        if let Some((lit, kind)) = LITERALS.iter().find(|(l, _)| text[m..].starts_with(l)) {
            out.push(tk(*kind, m, m + lit.len()));
            pos = m + lit.len();
            continue;
        }
        let tail = &text[m..];
        if LITERALS.iter().any(|(l, _)| l.starts_with(tail)) {
            out.push(tk(Tok::Text, m, text.len()));
            pos = text.len();
            break;
        }
        unknown = true;
        out.push(tk(Tok::Text, m, m + 2));
        match text[m + 2..].find("|>").map(|c| m + 2 + c) {
            Some(close) => match text[close + 2..].find("<|").map(|n| close + 2 + n) {
                Some(next) => {
                    out.push(tk(Tok::Text, m + 2, next));
                    pos = next;
                }
                None => {
                    out.push(tk(Tok::Text, m + 2, text.len()));
                    pos = text.len();
                    break;
                }
            },
            None => pos = m + 2,
        }
    }
    if pos < text.len() {
        out.push(tk(Tok::Text, pos, text.len()));
    } else if unknown && LITERALS.iter().any(|(l, _)| text.ends_with(l)) {
        out.push(tk(Tok::Text, pos, pos));
    }
    out
}

/// `prefix_hold`: (emit, hold) where hold is the longest suffix that may begin a token.
fn prefix_hold<'a>(text: &'a str, guards: &[&str]) -> (&'a str, &'a str) {
    let b = text.as_bytes();
    let mut hold = 0;
    for g in guards {
        let max = (g.len().saturating_sub(1)).min(b.len());
        for k in (1..=max).rev() {
            if g.as_bytes().starts_with(&b[b.len() - k..]) {
                hold = hold.max(k);
                break;
            }
        }
    }
    text.split_at(text.len() - hold)
}

const GUARDS: [&str; 7] = [
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|constrain|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
];

fn channel_type(header: &str) -> Option<&'static str> {
    let h = header.trim().to_lowercase();
    ["analysis", "commentary", "final"]
        .into_iter()
        .find(|c| h.starts_with(c))
}

fn is_standalone_structural(content: &str) -> bool {
    GUARDS.contains(&content.trim())
}

/// `CanonicalStrategy.parse`: (events, text held for the next call).
fn canonical(text: &str) -> (Vec<Event>, String) {
    let toks = tokens(text);
    let mut events = Vec::new();
    let mut pos = 0;
    while pos < toks.len() {
        let t = toks[pos];
        match t.kind {
            Tok::Text if pos == toks.len() - 1 => {
                let (emit, hold) = prefix_hold(&text[t.start..t.end], &GUARDS);
                if !emit.is_empty() {
                    events.push(ev(Kind::Normal, emit));
                }
                return (events, hold.to_owned());
            }
            Tok::Start | Tok::Channel => match block(text, &toks, pos) {
                Some((e, next)) => {
                    events.extend(e);
                    pos = next;
                }
                None => {
                    if let Some((e, rest)) = partial_analysis(text, &toks, pos) {
                        events.push(e);
                        return (events, rest);
                    }
                    return (events, text[toks[pos].start..].to_owned());
                }
            },
            _ => {
                if !filler(text, &toks, pos) {
                    let content = &text[t.start..t.end];
                    if !is_standalone_structural(content) {
                        events.push(ev(Kind::Normal, content));
                    }
                }
                pos += 1;
            }
        }
    }
    (events, String::new())
}

fn partial_analysis(text: &str, toks: &[Token], start: usize) -> Option<(Event, String)> {
    let mut pos = start;
    if toks.get(pos).map(|t| t.kind) == Some(Tok::Start) {
        pos += 1;
    }
    let (channel, message) = channel_and_message(toks, pos);
    let (channel, message) = (channel?, message?);
    let header_start = toks.get(channel + 1).map_or(toks[channel].end, |t| t.start);
    let header = text.get(header_start..toks[message].start).unwrap_or("");
    if channel_type(header) != Some("analysis") {
        return None;
    }
    let content_start = toks[message].end;
    Some((
        ev(Kind::Reasoning, &text[content_start..]),
        text[toks[start].start..content_start].to_owned(),
    ))
}

/// The first CHANNEL at or after `from` and the first MESSAGE after it.
fn channel_and_message(toks: &[Token], from: usize) -> (Option<usize>, Option<usize>) {
    let mut channel = None;
    for (i, t) in toks.iter().enumerate().skip(from) {
        if t.kind == Tok::Channel && channel.is_none() {
            channel = Some(i);
        } else if t.kind == Tok::Message {
            return (channel, Some(i));
        }
    }
    (channel, None)
}

/// `_parse_block`: the block's event (if any) and the next token; `None`: incomplete.
fn block(text: &str, toks: &[Token], start: usize) -> Option<(Option<Event>, usize)> {
    let mut pos = start;
    if toks.get(pos).map(|t| t.kind) == Some(Tok::Start) {
        pos += 1;
    }
    let (channel, message) = channel_and_message(toks, pos);
    let message = message?;
    let Some(channel) = channel else {
        let content_start = toks[message].end;
        let end = (message + 1..toks.len())
            .find(|&i| matches!(toks[i].kind, Tok::End | Tok::Call | Tok::Return))?;
        return Some((
            Some(ev(Kind::Normal, &text[content_start..toks[end].start])),
            end + 1,
        ));
    };
    let pos = channel + 1;
    let header_start = toks.get(pos).map_or(toks[pos - 1].end, |t| t.start);
    let header = text.get(header_start..toks[message].start).unwrap_or("");
    let kind = channel_type(header)?;
    let content_start = toks[message].end;
    let mut end = message + 1;
    let ends: &[Tok] = if kind == "final" {
        &[Tok::Return]
    } else {
        &[Tok::End, Tok::Call]
    };
    while end < toks.len() && !ends.contains(&toks[end].kind) {
        end += 1;
    }
    if end >= toks.len() {
        if kind == "final" {
            return Some((Some(ev(Kind::Normal, &text[content_start..])), end));
        }
        return None;
    }
    let end_tok = toks[end];
    let content = &text[content_start..end_tok.start];
    let call = |c: &str| Event {
        kind: Kind::ToolCall,
        content: c.trim().to_owned(),
        raw: Some(text[toks[start].start..end_tok.end].to_owned()),
    };
    Some(match kind {
        "analysis" if end_tok.kind == Tok::Call => (Some(call(content)), end + 1),
        "analysis" => (Some(ev(Kind::Reasoning, content)), end + 1),
        "commentary" if end_tok.kind == Tok::Call => (Some(call(content)), end + 1),
        "commentary" => (Some(ev(Kind::Normal, content)), end + 1),
        _ => {
            if end_tok.kind == Tok::Return
                && end + 1 < toks.len()
                && toks[end + 1].kind == Tok::Text
            {
                let next = toks[end + 1];
                let c = format!("{content}{}", &text[next.start..next.end]);
                (Some(ev(Kind::Normal, &c)), end + 2)
            } else {
                (Some(ev(Kind::Normal, content)), end + 1)
            }
        }
    })
}

/// `_is_commentary_filler_between_blocks`.
fn filler(text: &str, toks: &[Token], pos: usize) -> bool {
    let cur = toks[pos];
    let cur_text = text[cur.start..cur.end].trim().to_lowercase();
    if pos == 0 {
        return false;
    }
    let prev = toks[pos - 1];
    if pos + 1 < toks.len()
        && prev.kind == Tok::Call
        && toks[pos + 1].kind == Tok::Channel
        && cur_text == "commentary"
    {
        return true;
    }
    prev.kind == Tok::Call
        && (cur.kind == Tok::Message || (cur.kind == Tok::Text && cur_text == "commentary"))
}

static ANALYSIS_THEN_FINAL: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?is)\A\s*(?:assistant)?\s*(analysis|commentary)(.*?)\s*assistantfinal\s*(.*)\s*\z",
    )
    .expect("a valid pattern")
});
static FINAL_ONLY: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?is)\A\s*assistantfinal\s*(.*)\s*\z").expect("a valid pattern"));
static ANALYSIS_ONLY: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?is)\A\s*(?:assistant)?\s*(analysis|commentary)(.*)\s*\z")
        .expect("a valid pattern")
});
static CHANNEL_WORD: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)(?:^|\s)(?:assistant)?\s*(analysis|commentary)").expect("a valid pattern")
});
static TEXT_FORMAT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)(?:^|\s)(?:assistant)?\s*(analysis|commentary|assistantfinal)")
        .expect("a valid pattern")
});

/// `TextStrategy.parse`: the fallback for replies whose markers were decoded away.
fn text_strategy(text: &str) -> (Vec<Event>, String) {
    let mut events = Vec::new();
    if let Some(c) = ANALYSIS_THEN_FINAL.captures(text) {
        let channel = c[1].to_lowercase();
        let reasoning = c[2].trim();
        let fin = c[3].trim();
        if channel == "analysis" && !reasoning.is_empty() {
            events.push(ev(Kind::Reasoning, reasoning));
        } else if channel == "commentary" && !reasoning.is_empty() {
            events.push(ev(Kind::Normal, reasoning));
        }
        if !fin.is_empty() {
            events.push(ev(Kind::Normal, fin));
        }
        return (events, String::new());
    }
    if CHANNEL_WORD.is_match(text) {
        let low = text.to_lowercase();
        if low.contains("assistantfin") && !low.contains("assistantfinal") {
            return (events, text.to_owned());
        }
    }
    if let Some(c) = FINAL_ONLY.captures(text) {
        let fin = c[1].trim();
        if !fin.is_empty() {
            events.push(ev(Kind::Normal, fin));
        }
        return (events, String::new());
    }
    if let Some(c) = ANALYSIS_ONLY.captures(text) {
        let channel = c[1].to_lowercase();
        let body = c.get(2).expect("group 2 takes part in every match");
        let (emit, hold) = prefix_hold(body.as_str(), &["assistantfinal"]);
        let head = &text[..body.start()];
        if channel == "analysis" && !emit.is_empty() {
            events.push(ev(Kind::Reasoning, emit));
            let rest = if hold.is_empty() {
                c[1].to_owned()
            } else {
                format!("{head}{hold}")
            };
            return (events, rest);
        }
        if channel == "commentary" && !emit.is_empty() {
            let out = if hold.is_empty() { emit.trim() } else { emit };
            events.push(ev(Kind::Normal, out));
            let rest = if hold.is_empty() {
                String::new()
            } else {
                format!("{head}{hold}")
            };
            return (events, rest);
        }
        return (events, format!("{head}{hold}"));
    }
    let (emit, hold) = prefix_hold(text, &["analysis", "commentary", "assistantfinal"]);
    if !emit.is_empty() {
        events.push(ev(Kind::Normal, emit));
    }
    (events, hold.to_owned())
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Strategy {
    Canonical,
    Text,
}

/// `HarmonyParser`, fed a whole reply and then the flushing empty chunk.
#[derive(Default)]
struct Parser {
    strategy: Option<Strategy>,
    buffer: String,
    filter_commentary: bool,
    partial_commentary: String,
}

impl Parser {
    fn parse(&mut self, chunk: &str) -> Vec<Event> {
        self.buffer.push_str(chunk);
        if self.strategy.is_none() {
            if self.buffer.contains("<|channel|>") || self.buffer.contains("<|start|>") {
                self.strategy = Some(Strategy::Canonical);
            } else if TEXT_FORMAT.is_match(&self.buffer) {
                self.strategy = Some(Strategy::Text);
            } else {
                return Vec::new();
            }
        }
        let (events, remaining) = match self.strategy {
            Some(Strategy::Canonical) => canonical(&self.buffer),
            _ => text_strategy(&self.buffer),
        };
        let ends_with_call = self.buffer.trim_end().ends_with("<|call|>");
        self.buffer = remaining;
        let mut out = Vec::new();
        for e in events {
            if e.kind == Kind::Normal {
                if self.filter_commentary || !self.partial_commentary.is_empty() {
                    let candidate = format!(
                        "{}{}",
                        self.partial_commentary,
                        e.content.trim().to_lowercase()
                    );
                    if candidate == "commentary" {
                        self.partial_commentary.clear();
                        self.filter_commentary = false;
                        continue;
                    } else if "commentary".starts_with(&candidate) {
                        self.partial_commentary = candidate;
                        continue;
                    }
                    self.partial_commentary.clear();
                    self.filter_commentary = false;
                } else {
                    self.partial_commentary.clear();
                }
            }
            if e.kind == Kind::ToolCall {
                self.filter_commentary = true;
                self.partial_commentary.clear();
            } else if ends_with_call {
                self.filter_commentary = true;
            }
            out.push(e);
        }
        out
    }
}

/// The events of a whole reply, as SGLang's one-shot callers read them.
pub fn events(text: &str) -> Vec<Event> {
    let mut p = Parser::default();
    let mut out = p.parse(text);
    out.extend(p.parse(""));
    out
}

/// SGLang's `gpt-oss` reasoning parser: (reasoning, answer), tool-call blocks kept whole
/// in the answer for the tool parser.
pub fn split_reasoning(text: &str) -> (Option<String>, String) {
    let evs = events(text);
    let reasoning: String = evs
        .iter()
        .filter(|e| e.kind == Kind::Reasoning)
        .map(|e| e.content.as_str())
        .collect();
    let answer: String = evs
        .iter()
        .filter_map(|e| match e.kind {
            Kind::Normal => Some(e.content.as_str()),
            Kind::ToolCall => Some(e.raw.as_deref().unwrap_or(&e.content)),
            Kind::Reasoning => None,
        })
        .collect();
    (Some(reasoning).filter(|r| !r.is_empty()), answer)
}

static TOOL_EXTRACT: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?s)to=([a-zA-Z_][a-zA-Z0-9_.-]*)\s*<\|constrain\|>json<\|message\|>(.*?)(?:<\|call\|>|\n?\z)")
        .expect("a valid pattern")
});

/// SGLang's `gpt-oss` tool parser: (answer, [(name, arguments)]).
pub fn split_calls(text: &str, tools: &[Value]) -> Option<(String, Vec<(String, String)>)> {
    if !text.contains("<|start|>assistant<|channel|>commentary") {
        return None;
    }
    let mut calls = Vec::new();
    let mut normal = Vec::new();
    for e in events(text) {
        match e.kind {
            Kind::ToolCall => {
                let body = e.raw.as_deref().unwrap_or(&e.content);
                let Some(c) = TOOL_EXTRACT.captures(body) else {
                    continue;
                };
                let full = &c[1];
                let name = full.rsplit('.').next().unwrap_or(full);
                if !offers(tools, name) {
                    continue;
                }
                let json = &c[2];
                let args = if json.trim().is_empty() {
                    Value::Object(Map::new())
                } else {
                    match loads(json) {
                        Some(v) => v,
                        None => continue,
                    }
                };
                calls.push((name.to_owned(), dumps(&args)));
            }
            Kind::Normal => normal.push(e.content),
            Kind::Reasoning => {}
        }
    }
    Some((normal.join(" ").trim().to_owned(), calls))
}
