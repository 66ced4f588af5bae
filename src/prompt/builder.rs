//! The prompt builder: a row's input becomes the exact text sent and, with a tokenizer,
//! its ids.
//!
//! Invariants: chat ids are the rendered text encoded without special tokens (the template
//! writes any BOS itself, exactly as transformers' `apply_chat_template(tokenize=True)`);
//! `prompt` rows get special tokens but never a second BOS. The builder is shared by every
//! intake worker, so it is `Send + Sync`.

use serde_json::{Map, Value as JsonValue};

use super::{ChatTemplate, TemplateError, Tokenizer};

/// What a row becomes: the exact text sent, and its ids when a tokenizer is configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuiltPrompt {
    /// The prompt text, byte for byte what is sent (or what the ids encode).
    pub text: String,
    /// The token ids of `text`, when a tokenizer is configured.
    pub token_ids: Option<Vec<u32>>,
}

/// Turns rows into prompts with the configured template and tokenizer; shared by all
/// workers (`Arc<PromptBuilder>`), so it is `Send + Sync`.
#[derive(Debug, Clone)]
pub struct PromptBuilder {
    template: Option<ChatTemplate>,
    tokenizer: Option<Tokenizer>,
    template_kwargs: Map<String, JsonValue>,
}

impl PromptBuilder {
    /// A builder with an optional template (needed for `messages` rows) and an optional
    /// tokenizer (needed for ids).
    pub fn new(template: Option<ChatTemplate>, tokenizer: Option<Tokenizer>) -> Self {
        Self {
            template,
            tokenizer,
            template_kwargs: Map::new(),
        }
    }

    /// Extra template variables for every chat row (such as `enable_thinking`).
    pub fn with_template_kwargs(mut self, kwargs: Map<String, JsonValue>) -> Self {
        self.template_kwargs = kwargs;
        self
    }

    /// A `messages` row: rendered with `add_generation_prompt = true`, then encoded
    /// without special tokens (the template writes BOS itself, as transformers does).
    /// Without a template this is [`TemplateError::NoTemplate`].
    pub fn build_chat(&self, messages: &JsonValue) -> Result<BuiltPrompt, TemplateError> {
        self.build_chat_with(messages, &Map::new())
    }

    /// A `messages` row rendered with the builder's template variables overridden by
    /// `extra` (`tools`, `enable_thinking`, drawn variables), as transformers'
    /// `apply_chat_template(messages, tools=…, **kwargs)`; otherwise as [`Self::build_chat`].
    pub fn build_chat_with(
        &self,
        messages: &JsonValue,
        extra: &Map<String, JsonValue>,
    ) -> Result<BuiltPrompt, TemplateError> {
        let template = self.template.as_ref().ok_or(TemplateError::NoTemplate)?;
        let text = if extra.is_empty() {
            template.render(messages, true, &self.template_kwargs)?
        } else {
            let mut kwargs = self.template_kwargs.clone();
            kwargs.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
            template.render(messages, true, &kwargs)?
        };
        let token_ids = match &self.tokenizer {
            Some(tokenizer) => Some(tokenizer.encode(&text, false)?),
            None => None,
        };
        Ok(BuiltPrompt { text, token_ids })
    }

    /// A `prompt` row: the text as is; ids with special tokens, but no second BOS when
    /// the text already starts with one (see [`Tokenizer::encode_prompt`]).
    pub fn build_text(&self, text: &str) -> Result<BuiltPrompt, TemplateError> {
        let token_ids = match &self.tokenizer {
            Some(tokenizer) => Some(tokenizer.encode_prompt(text)?),
            None => None,
        };
        Ok(BuiltPrompt {
            text: text.to_owned(),
            token_ids,
        })
    }

    /// Whether ids are produced (a tokenizer is configured).
    pub fn has_tokenizer(&self) -> bool {
        self.tokenizer.is_some()
    }

    /// Whether `messages` rows can be rendered (a template is configured).
    pub fn has_template(&self) -> bool {
        self.template.is_some()
    }

    /// The configured template, if any.
    pub fn template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// The configured tokenizer, if any.
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::path::{Path, PathBuf};

    fn fixture(rel: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/tokenizers")
            .join(rel)
    }

    /// phi3's tokenizer.json with a post-processor that prepends `<s>`, as Llama's does.
    fn tokenizer_adding_bos() -> Tokenizer {
        let path = fixture("phi3/tokenizer.json");
        let mut json: JsonValue = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        json["post_processor"] = json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
        });
        Tokenizer::from_bytes(&serde_json::to_vec(&json).unwrap(), path).unwrap()
    }

    /// A template writing BOS and a prompt already starting with it each get exactly one
    /// BOS, and a prompt without it gets one.
    #[test]
    fn no_double_bos() {
        let tokenizer = tokenizer_adding_bos();
        assert_eq!(tokenizer.special_prefix(), "<s>");
        let plain = tokenizer.encode("Hello", false).unwrap();
        assert_eq!(tokenizer.encode("Hello", true).unwrap()[0], 1);
        let bos_template = ChatTemplate::from_source(
            "{{ bos_token }}{% for m in messages %}<|user|>\n{{ m.content }}<|end|>\n{% endfor %}<|assistant|>\n",
            Map::from_iter([("bos_token".to_owned(), json!("<s>"))]),
            PathBuf::from("bos.jinja"),
        )
        .unwrap();
        let builder = PromptBuilder::new(Some(bos_template), Some(tokenizer));

        let chat = builder
            .build_chat(&json!([{"role": "user", "content": "Hello"}]))
            .unwrap();
        assert!(chat.text.starts_with("<s><|user|>"));
        let ids = chat.token_ids.unwrap();
        assert_eq!(ids[0], 1);
        assert_ne!(ids[1], 1, "double BOS in chat ids: {ids:?}");

        // A prompt already carrying BOS gets no second one ...
        let text = builder.build_text("<s>Hello").unwrap();
        assert_eq!(text.text, "<s>Hello");
        let ids = text.token_ids.unwrap();
        assert_eq!(ids.iter().filter(|&&id| id == 1).count(), 1, "{ids:?}");
        assert_eq!(&ids[1..], &plain[..]);
        // ... and one without BOS gets exactly one.
        let ids = builder.build_text("Hello").unwrap().token_ids.unwrap();
        assert_eq!(ids[0], 1);
        assert_eq!(&ids[1..], &plain[..]);
    }

    /// Without a template a `messages` row is `NoTemplate`; without a tokenizer a prompt
    /// has text and no ids.
    #[test]
    fn builder_without_template_or_tokenizer() {
        let builder = PromptBuilder::new(None, None);
        assert!(!builder.has_template() && !builder.has_tokenizer());
        assert!(matches!(
            builder.build_chat(&json!([])),
            Err(TemplateError::NoTemplate)
        ));
        assert_eq!(
            builder.build_text("x").unwrap(),
            BuiltPrompt {
                text: "x".into(),
                token_ids: None
            }
        );
    }

    /// The types every intake worker shares are `Send + Sync + Clone`.
    #[test]
    fn shared_types_are_send_sync() {
        fn check<T: Send + Sync + Clone>() {}
        check::<ChatTemplate>();
        check::<Tokenizer>();
        check::<PromptBuilder>();
    }
}
