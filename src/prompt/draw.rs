//! Per-generation draws: the sampling parameters and template variables one generation
//! is sent with, drawn from a dataset's weighted lists by a seeded hash of (dataset, id,
//! sample), so a resumed run draws exactly what the first one did.
//!
//! Invariants: a draw depends only on (dataset, id, sample, the rules), never on order,
//! time or process; each drawn key hashes its own name too, so keys are independent. With
//! a `seed`, sample 0 is sent that seed and sample s > 0 the seed plus s (wrapping);
//! without one, no seed is sent.

use crate::config::{Choice, Config, DatasetConfig, Reasoning, Sampling};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// What one generation is sent with.
#[derive(Debug, Clone, PartialEq)]
pub struct Draw {
    pub sampling: Sampling,
    /// Template variables (rendered client-side, or sent as `chat_template_kwargs`).
    pub chat_template_kwargs: Map<String, Value>,
    /// The `sampling` column: what was drawn or set, as a JSON object.
    pub record: String,
}

/// One template variable: a value, or a weighted draw.
#[derive(Debug, Clone)]
enum Rule {
    Fixed(Value),
    Weighted(Vec<(Value, u64)>),
}

/// A dataset's draw rules.
#[derive(Debug, Clone)]
pub struct Drawer {
    sampling: Sampling,
    kwargs: Vec<(String, Rule)>,
    temperature: Option<Vec<(f64, u64)>>,
    top_p: Option<Vec<(f64, u64)>>,
    /// Sample 0's draw when nothing is drawn per row: every item's first generation gets
    /// it, so the hot path clones it instead of drawing and printing it again.
    constant: std::sync::OnceLock<Draw>,
}

/// Seeds the draw hash; changing it changes every draw of every resumed run.
const DRAW_SEED: u64 = 0x5350_4f4f_4c44_5257;

/// A table key as the value it stands for: JSON scalars (`true`, `0.6`) become those
/// values, anything else is the string itself.
fn key_value(key: &str) -> Value {
    match serde_json::from_str::<Value>(key) {
        Ok(v @ (Value::Bool(_) | Value::Number(_) | Value::Null)) => v,
        _ => Value::String(key.to_owned()),
    }
}

/// A weighted table of a template variable, or why it is not one.
fn weights(key: &str, table: &Map<String, Value>) -> Result<Vec<(Value, u64)>, String> {
    if table.is_empty() {
        return Err(format!(
            "chat_template_kwargs.{key}: an empty table has nothing to draw"
        ));
    }
    table
        .iter()
        .map(|(k, w)| match w.as_u64() {
            Some(n) if n > 0 => Ok((key_value(k), n)),
            _ => Err(format!(
                "chat_template_kwargs.{key}: a table is a weighted draw, so the weight of `{k}` \
                 must be a positive integer, not {w}"
            )),
        })
        .collect()
}

impl Drawer {
    /// The rules of a dataset: its sampling, template variables (a table of integer
    /// weights is a weighted draw) and reasoning mode (`disable` sets `enable_thinking`).
    pub fn new(
        sampling: &Sampling,
        kwargs: &Map<String, Value>,
        reasoning: Reasoning,
    ) -> Result<Drawer, String> {
        let mut rules = Vec::with_capacity(kwargs.len() + 1);
        for (k, v) in kwargs {
            let rule = match v {
                Value::Object(table) => Rule::Weighted(weights(k, table)?),
                other => Rule::Fixed(other.clone()),
            };
            rules.push((k.clone(), rule));
        }
        if reasoning == Reasoning::Disable {
            match rules.iter().find(|(k, _)| k == "enable_thinking") {
                Some((_, Rule::Fixed(Value::Bool(false)))) => {}
                Some(_) => {
                    return Err("chat_template_kwargs.enable_thinking: conflicts with \
                                `reasoning = \"disable\"` (which sets it to false)"
                        .into())
                }
                None => rules.push(("enable_thinking".into(), Rule::Fixed(Value::Bool(false)))),
            }
        }
        Ok(Drawer {
            sampling: sampling.clone(),
            kwargs: rules,
            temperature: None,
            top_p: None,
            constant: Default::default(),
        })
    }

    /// These rules with `temperature` and `top_p` drawn per generation from lists or
    /// weighted tables (a single number stays fixed).
    pub fn with_choices(
        mut self,
        temperature: Option<&Choice>,
        top_p: Option<&Choice>,
    ) -> Result<Drawer, String> {
        self.constant = Default::default();
        let options = |c: Option<&Choice>, key: &str| -> Result<_, String> {
            match c {
                None | Some(Choice::One(_)) => Ok(None),
                Some(c) => c
                    .options()
                    .map(Some)
                    .map_err(|e| format!("sampling.{key}: {e}")),
            }
        };
        self.temperature = options(temperature, "temperature")?;
        self.top_p = options(top_p, "top_p")?;
        Ok(self)
    }

    /// The rules of dataset `d` of `cfg`: its sampling (with its lists), its generation
    /// keys with the top level's defaults.
    pub fn of_dataset(cfg: &Config, d: &DatasetConfig) -> Result<Drawer, String> {
        let spec = cfg.generation_of(d);
        Drawer::new(
            &cfg.sampling_of(d),
            &spec.chat_template_kwargs,
            spec.reasoning,
        )?
        .with_choices(d.sampling.temperature.as_ref(), d.sampling.top_p.as_ref())
    }

    /// The draw of generation `sample` of item `id` of dataset `dataset`.
    pub fn draw(&self, dataset: &str, id: &str, sample: u32) -> Draw {
        let constant =
            self.temperature.is_none() && self.top_p.is_none() && self.is_fixed() && sample == 0;
        if constant {
            return self
                .constant
                .get_or_init(|| self.draw_now(dataset, id, 0))
                .clone();
        }
        self.draw_now(dataset, id, sample)
    }

    fn draw_now(&self, dataset: &str, id: &str, sample: u32) -> Draw {
        let pick = |key: &str, total: u64| -> u64 {
            let mut bytes = Vec::with_capacity(dataset.len() + id.len() + key.len() + 8);
            for part in [
                dataset.as_bytes(),
                id.as_bytes(),
                &sample.to_le_bytes(),
                key.as_bytes(),
            ] {
                bytes.extend_from_slice(part);
                bytes.push(0);
            }
            twox_hash::XxHash64::oneshot(DRAW_SEED, &bytes) % total
        };
        fn choose<T>(options: &[(T, u64)], mut r: u64) -> &T {
            for (v, w) in options {
                if r < *w {
                    return v;
                }
                r -= w;
            }
            // `r` is below the total weight, so the loop returned; the last option is
            // the only value this line could mean.
            &options[options.len() - 1].0
        }
        let total = |o: &[(f64, u64)]| o.iter().map(|(_, w)| w).sum::<u64>();
        let mut sampling = self.sampling.clone();
        if let Some(o) = &self.temperature {
            sampling.temperature = *choose(o, pick("sampling.temperature", total(o)));
        }
        if let Some(o) = &self.top_p {
            sampling.top_p = *choose(o, pick("sampling.top_p", total(o)));
        }
        sampling.seed = sampling.seed.map(|s| s.wrapping_add(u64::from(sample)));
        let mut kwargs = Map::new();
        for (k, rule) in &self.kwargs {
            let v = match rule {
                Rule::Fixed(v) => v.clone(),
                Rule::Weighted(o) => {
                    let t = o.iter().map(|(_, w)| w).sum::<u64>();
                    choose(o, pick(k, t)).clone()
                }
            };
            kwargs.insert(k.clone(), v);
        }
        let mut record = BTreeMap::new();
        record.insert("temperature", Value::from(sampling.temperature));
        record.insert("top_p", Value::from(sampling.top_p));
        if let Some(s) = sampling.seed {
            record.insert("seed", Value::from(s));
        }
        if !kwargs.is_empty() {
            let sorted: BTreeMap<&String, &Value> = kwargs.iter().collect();
            record.insert("chat_template_kwargs", serde_json::json!(sorted));
        }
        let record = serde_json::to_string(&record).unwrap_or_default();
        Draw {
            sampling,
            chat_template_kwargs: kwargs,
            record,
        }
    }

    /// The template variables every generation gets (a drawn one left out): what intake
    /// renders the stored prompt with.
    pub fn fixed_kwargs(&self) -> Map<String, Value> {
        self.kwargs
            .iter()
            .filter_map(|(k, r)| match r {
                Rule::Fixed(v) => Some((k.clone(), v.clone())),
                Rule::Weighted(_) => None,
            })
            .collect()
    }

    /// Whether every generation gets the same template variables (the prompt rendered at
    /// intake holds for all of them).
    pub fn is_fixed(&self) -> bool {
        self.kwargs.iter().all(|(_, r)| matches!(r, Rule::Fixed(_)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn kwargs(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    fn effort() -> Drawer {
        Drawer::new(
            &Sampling::default(),
            &kwargs(json!({"reasoning_effort": {"low": 4, "medium": 4, "high": 2}, "x": 1})),
            Reasoning::Save,
        )
        .unwrap()
    }

    /// A 4/4/2 table is drawn in those proportions over 10k rows (within 2 points).
    #[test]
    fn weighted_draws_follow_their_weights() {
        let d = effort();
        assert!(!d.is_fixed());
        let mut counts = BTreeMap::new();
        for i in 0..10_000 {
            let draw = d.draw("ds", &format!("row{i}"), 0);
            let e = draw.chat_template_kwargs["reasoning_effort"]
                .as_str()
                .unwrap()
                .to_owned();
            assert_eq!(draw.chat_template_kwargs["x"], 1);
            *counts.entry(e).or_insert(0u32) += 1;
        }
        for (k, want) in [("low", 0.4), ("medium", 0.4), ("high", 0.2)] {
            let got = f64::from(counts[k]) / 10_000.0;
            assert!(
                (got - want).abs() < 0.02,
                "{k}: {got} vs {want} ({counts:?})"
            );
        }
    }

    /// The same (dataset, id, sample) draws the same in another Drawer (a resumed run);
    /// samples of one row are drawn independently.
    #[test]
    fn draws_are_stable_across_drawers() {
        let (a, b) = (effort(), effort());
        let mut differs = false;
        for i in 0..200 {
            let id = format!("r{i}");
            assert_eq!(a.draw("ds", &id, 3), b.draw("ds", &id, 3));
            differs |= a.draw("ds", &id, 0).record != a.draw("ds", &id, 1).record;
        }
        assert!(differs, "every sample drew the same");
        assert_eq!(
            a.draw("ds", "r1", 0).record,
            "{\"chat_template_kwargs\":{\"reasoning_effort\":\"".to_owned()
                + a.draw("ds", "r1", 0).chat_template_kwargs["reasoning_effort"]
                    .as_str()
                    .unwrap()
                + "\",\"x\":1},\"temperature\":0.7,\"top_p\":0.95}"
        );
    }

    /// Temperature lists and tables are drawn per row; JSON-scalar keys become numbers
    /// and booleans; the seed is kept for sample 0 and moved by the sample index after.
    #[test]
    fn sampling_lists_seeds_and_scalar_keys() {
        let s = Sampling {
            seed: Some(42),
            ..Sampling::default()
        };
        let d = Drawer::new(
            &s,
            &kwargs(json!({"enable_thinking": {"true": 1, "false": 1}})),
            Reasoning::Save,
        )
        .unwrap()
        .with_choices(
            Some(&Choice::Weighted(vec![(0.6, 3), (1.0, 1)])),
            Some(&Choice::List(vec![0.9, 0.95])),
        )
        .unwrap();
        let mut temps = std::collections::BTreeSet::new();
        let mut thinking = std::collections::BTreeSet::new();
        for i in 0..100 {
            let dr = d.draw("ds", &i.to_string(), 0);
            temps.insert(dr.sampling.temperature.to_string());
            assert!([0.9, 0.95].contains(&dr.sampling.top_p));
            thinking.insert(
                dr.chat_template_kwargs["enable_thinking"]
                    .as_bool()
                    .unwrap(),
            );
            assert_eq!(dr.sampling.seed, Some(42));
        }
        assert_eq!(temps.into_iter().collect::<Vec<_>>(), ["0.6", "1"]);
        assert_eq!(thinking.len(), 2);
        assert_eq!(d.draw("ds", "a", 2).sampling.seed, Some(44));
        let unseeded = Drawer::new(&Sampling::default(), &Map::new(), Reasoning::Save).unwrap();
        assert!(unseeded.is_fixed());
        let dr = unseeded.draw("ds", "a", 5);
        assert_eq!(dr.sampling.seed, None);
        assert_eq!(dr.record, "{\"temperature\":0.7,\"top_p\":0.95}");
    }

    /// `reasoning = "disable"` adds `enable_thinking = false`, and a contrary setting is
    /// refused; bad tables are refused naming the key.
    #[test]
    fn disable_and_validation() {
        let d = Drawer::new(&Sampling::default(), &Map::new(), Reasoning::Disable).unwrap();
        assert_eq!(d.fixed_kwargs(), kwargs(json!({"enable_thinking": false})));
        assert_eq!(
            d.draw("a", "b", 0).chat_template_kwargs["enable_thinking"],
            false
        );
        let e = Drawer::new(
            &Sampling::default(),
            &kwargs(json!({"enable_thinking": true})),
            Reasoning::Disable,
        )
        .unwrap_err();
        assert!(e.contains("enable_thinking"), "{e}");
        for (bad, says) in [
            (json!({"effort": {"low": 0}}), "`low`"),
            (json!({"effort": {"low": 1.5}}), "positive integer"),
            (json!({"effort": {}}), "empty"),
        ] {
            let e = Drawer::new(&Sampling::default(), &kwargs(bad), Reasoning::Save).unwrap_err();
            assert!(
                e.contains("chat_template_kwargs.effort") && e.contains(says),
                "{e}"
            );
        }
    }
}
