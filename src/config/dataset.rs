//! The `[[dataset]]` tables and the generation keys: sampling (a number or a draw per
//! generation), reasoning, turns, samples, template variables, and how each dataset's
//! keys fall back on the top level's.
//!
//! Invariants: an unknown key is refused; a drawn value (`Choice`) holds at least one
//! finite number with positive integer weights; a dataset's effective keys are its own,
//! else the top level's, else the defaults.

use super::Config;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Sampling parameters; `[sampling]` gives defaults, `[dataset.sampling]` overrides per key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sampling {
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    #[serde(default = "default_temperature")]
    pub temperature: f64,
    #[serde(default = "default_top_p")]
    pub top_p: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Vec<String>>,
}

/// Per-dataset overrides: every key optional.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingOverride {
    pub max_tokens: Option<u32>,
    /// A number, a list (drawn uniformly per generation) or a weighted table.
    pub temperature: Option<Choice>,
    /// A number, a list (drawn uniformly per generation) or a weighted table.
    pub top_p: Option<Choice>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<u64>,
    pub stop: Option<Vec<String>>,
}

/// A sampling value of a dataset: one number, or several drawn from per generation
/// (`[0.6, 1.0]` uniformly, `{ "0.6" = 3, "1.0" = 1 }` by weight).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "serde_json::Value", into = "serde_json::Value")]
pub enum Choice {
    One(f64),
    List(Vec<f64>),
    Weighted(Vec<(f64, u64)>),
}

impl Choice {
    /// The value used where one number is needed (the first listed; a table's first
    /// value in file order); the per-generation draw is [`crate::prompt::draw::Drawer`]'s.
    pub fn first(&self) -> f64 {
        match self {
            Choice::One(v) => *v,
            Choice::List(l) => l.first().copied().unwrap_or(f64::NAN),
            Choice::Weighted(w) => w.first().map_or(f64::NAN, |(v, _)| *v),
        }
    }

    /// The values and their weights (1 each for a list).
    pub fn options(&self) -> Result<Vec<(f64, u64)>, String> {
        match self {
            Choice::One(v) => Ok(vec![(*v, 1)]),
            Choice::List(l) => Ok(l.iter().map(|v| (*v, 1)).collect()),
            Choice::Weighted(w) => Ok(w.clone()),
        }
    }
}

impl TryFrom<serde_json::Value> for Choice {
    type Error = String;

    fn try_from(v: serde_json::Value) -> Result<Choice, String> {
        use serde_json::Value;
        let number = |v: &Value| {
            v.as_f64()
                .filter(|f| f.is_finite())
                .ok_or_else(|| format!("{v} is not a number"))
        };
        match &v {
            Value::Number(_) => number(&v).map(Choice::One),
            Value::Array(l) if l.is_empty() => Err("an empty list has nothing to draw".into()),
            Value::Array(l) => l
                .iter()
                .map(number)
                .collect::<Result<_, _>>()
                .map(Choice::List),
            Value::Object(t) if t.is_empty() => Err("an empty table has nothing to draw".into()),
            Value::Object(t) => t
                .iter()
                .map(|(k, w)| {
                    let value = k
                        .trim()
                        .parse::<f64>()
                        .ok()
                        .filter(|f| f.is_finite())
                        .ok_or_else(|| format!("table key `{k}` is not a number"))?;
                    match w.as_u64() {
                        Some(n) if n > 0 => Ok((value, n)),
                        _ => Err(format!(
                            "the weight of `{k}` must be a positive integer, not {w}"
                        )),
                    }
                })
                .collect::<Result<_, _>>()
                .map(Choice::Weighted),
            other => Err(format!(
                "expected a number, a list of numbers or a table of weights, not {other}"
            )),
        }
    }
}

impl From<Choice> for serde_json::Value {
    fn from(c: Choice) -> serde_json::Value {
        use serde_json::Value;
        match c {
            Choice::One(v) => Value::from(v),
            Choice::List(l) => Value::from(l),
            Choice::Weighted(w) => Value::Object(
                w.into_iter()
                    .map(|(v, n)| (v.to_string(), Value::from(n)))
                    .collect(),
            ),
        }
    }
}

/// One prompt set.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetConfig {
    pub name: String,
    pub path: PathBuf,
    #[serde(default)]
    pub token_budget: Option<u64>,
    #[serde(default)]
    pub max_prompts: Option<u64>,
    #[serde(default)]
    pub sampling: SamplingOverride,
    /// Overrides of the top level's generation keys.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<Reasoning>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turns: Option<Turns>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history_reasoning: Option<HistoryReasoning>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples: Option<u32>,
    /// Template variables; a table of integer weights is drawn from per row.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// What a turn cut by `max_tokens` does to its conversation (`turns = "all"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_length: Option<OnLength>,
    /// How a `prompt` row reaches the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_format: Option<PromptFormat>,
}

/// The most generations per prompt (`samples`): a bound on one item's kept generations.
pub const MAX_SAMPLES: u32 = 1024;

/// What happens to the model's thinking.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Reasoning {
    /// Kept apart from the answer, in the `reasoning` column.
    #[default]
    Save,
    /// Thinking switched off (`enable_thinking = false` in the template or the request).
    Disable,
    /// Left in the completion text as generated.
    Raw,
}

/// Which assistant turns of a conversation are generated.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Turns {
    /// The last one, after the conversation as given.
    #[default]
    Last,
    /// Every one, in order, each after the replies generated before it (on-policy).
    All,
}

/// Whether earlier generated turns' thinking is sent back in a conversation's history.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HistoryReasoning {
    #[default]
    Drop,
    Keep,
}

/// What a turn cut by `max_tokens` does to the rest of its conversation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnLength {
    /// The conversation ends there, partial (`partial = "length"`): no later turn is
    /// conditioned on a cut reply.
    #[default]
    Stop,
    /// Later turns go on after the cut reply.
    Continue,
}

/// How a `prompt` row is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PromptFormat {
    /// As one user turn through the chat template, as a chat model sees a request.
    Chat,
    /// The text as is, no template.
    Raw,
}

/// A dataset's generation keys with the defaults applied.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationSpec {
    pub reasoning: Reasoning,
    pub turns: Turns,
    pub history_reasoning: HistoryReasoning,
    pub samples: u32,
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    pub on_length: OnLength,
    /// None: the default, `chat` where a chat template renders prompts, else `raw`.
    pub prompt_format: Option<PromptFormat>,
}

impl GenerationSpec {
    /// Whether an item of this dataset has more than one generation (and so is kept in
    /// parts until it is closed).
    pub fn is_multi(&self) -> bool {
        self.samples > 1 || self.turns == Turns::All
    }
}

impl Config {
    /// The dataset's effective sampling parameters.
    pub fn sampling_of(&self, d: &DatasetConfig) -> Sampling {
        self.sampling.with(&d.sampling)
    }

    /// The generation keys of dataset `d`: its own, else the top level's, else defaults.
    pub fn generation_of(&self, d: &DatasetConfig) -> GenerationSpec {
        let (own, top) = (d, self);
        let mut kwargs = top.chat_template_kwargs.clone().unwrap_or_default();
        if let Some(k) = &own.chat_template_kwargs {
            kwargs.extend(k.clone());
        }
        GenerationSpec {
            reasoning: own.reasoning.or(top.reasoning).unwrap_or_default(),
            turns: own.turns.or(top.turns).unwrap_or_default(),
            history_reasoning: own
                .history_reasoning
                .or(top.history_reasoning)
                .unwrap_or_default(),
            samples: own.samples.or(top.samples).unwrap_or(1),
            chat_template_kwargs: kwargs,
            on_length: own.on_length.or(top.on_length).unwrap_or_default(),
            prompt_format: own.prompt_format.or(top.prompt_format),
        }
    }
}

fn default_max_tokens() -> u32 {
    10240
}
fn default_temperature() -> f64 {
    0.7
}
fn default_top_p() -> f64 {
    0.95
}

impl Default for Sampling {
    fn default() -> Self {
        Self {
            max_tokens: default_max_tokens(),
            temperature: default_temperature(),
            top_p: default_top_p(),
            top_k: None,
            min_p: None,
            seed: None,
            stop: None,
        }
    }
}

impl Sampling {
    /// The effective sampling of a dataset: the defaults with its overrides applied.
    pub fn with(&self, o: &SamplingOverride) -> Sampling {
        Sampling {
            max_tokens: o.max_tokens.unwrap_or(self.max_tokens),
            temperature: o
                .temperature
                .as_ref()
                .map_or(self.temperature, Choice::first),
            top_p: o.top_p.as_ref().map_or(self.top_p, Choice::first),
            top_k: o.top_k.or(self.top_k),
            min_p: o.min_p.or(self.min_p),
            seed: o.seed.or(self.seed),
            stop: o.stop.clone().or_else(|| self.stop.clone()),
        }
    }
}
