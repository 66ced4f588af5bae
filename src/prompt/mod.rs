//! Stage 2, prompt: a row becomes the text and token ids the server is sent, rendered by
//! the model's own chat template and tokenizer as HuggingFace would.
//!
//! Invariant: the prompt ids are those `transformers` would produce for the same row; the
//! goldens under `tests/fixtures` pin it.

pub mod byte_bpe;
pub mod template;
