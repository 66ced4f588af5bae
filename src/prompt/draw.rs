//! Per-generation draws: the sampling parameters and template variables one generation
//! is sent with, drawn from a dataset's weighted lists by a seeded hash of (dataset, id,
//! sample), so a resumed run draws exactly what the first one did.

use crate::config::{Reasoning, Sampling};
use serde_json::{Map, Value};

/// What one generation is sent with.
#[derive(Debug, Clone, PartialEq)]
pub struct Draw {
    pub sampling: Sampling,
    /// Template variables (rendered client-side, or sent as `chat_template_kwargs`).
    pub chat_template_kwargs: Map<String, Value>,
    /// The `sampling` column: what was drawn or set, as a JSON object.
    pub record: String,
}

/// A dataset's draw rules.
#[derive(Debug, Clone)]
pub struct Drawer {
    sampling: Sampling,
    kwargs: Map<String, Value>,
    reasoning: Reasoning,
}

impl Drawer {
    /// The rules of a dataset: its sampling, template variables (a table of integer
    /// weights is a weighted draw) and reasoning mode (`disable` sets `enable_thinking`).
    pub fn new(
        sampling: &Sampling,
        kwargs: &Map<String, Value>,
        reasoning: Reasoning,
    ) -> Result<Drawer, String> {
        Ok(Drawer {
            sampling: sampling.clone(),
            kwargs: kwargs.clone(),
            reasoning,
        })
    }

    /// The draw of generation `sample` of item `id` of dataset `dataset`.
    pub fn draw(&self, _dataset: &str, _id: &str, _sample: u32) -> Draw {
        let _ = (&self.sampling, &self.kwargs, self.reasoning);
        unimplemented!("draw")
    }

    /// Whether every generation gets the same template variables (the prompt rendered at
    /// intake holds for all of them).
    pub fn is_fixed(&self) -> bool {
        unimplemented!("is_fixed")
    }
}
