//! Prompt construction: HuggingFace chat templates and `tokenizer.json` tokenizers.
//!
//! A dataset row becomes the exact text sent to the server and, when a tokenizer is
//! configured, its token ids. This module keeps these invariants:
//!
//! - **Rendering is transformers' `apply_chat_template`**: a Jinja environment with
//!   `trim_blocks`, `lstrip_blocks`, loop controls, no autoescape, jinja2's default
//!   undefined behaviour, and transformers' globals (`raise_exception`, `strftime_now`)
//!   and `tojson` (Python `json.dumps(ensure_ascii=False)`: `", "`/`": "` separators, key
//!   order kept, no HTML escaping). Values print the way Python's `str()` prints them
//!   (`None`, `True`, `['a', 1]`). JSON objects keep their key order end to end.
//!   The special tokens transformers passes (`bos_token`, `eos_token`, …) are top-level
//!   variables, and `tools` / `documents` are defined (as `none`) even when absent.
//! - **Chat ids are the rendered text encoded without special tokens**: the template
//!   writes any BOS itself, exactly as transformers' `apply_chat_template(tokenize=True)`.
//! - **Plain prompts never get a double BOS**: `prompt` rows are encoded with special
//!   tokens, unless the text already starts with the text of the tokens the tokenizer
//!   would prepend.
//! - Tokenizers never truncate or pad, whatever `tokenizer.json` says: budgets and
//!   length checks need the true counts.
//! - Every error names the file it comes from; a template's `raise_exception` is its
//!   own variant ([`TemplateError::Raised`]) so callers can reject just that row.
//! - Everything here is `Send + Sync` and cheap to clone (shared through `Arc`).
//!
//! Known differences from jinja2, none of which the shipped goldens exercise: dict
//! literals written inside a template iterate in sorted key order (minijinja without
//! `preserve_order`), `~` and `|string` print `none`/`true` rather than `None`/`True`,
//! `{% generation %}` blocks (transformers' assistant-mask extension) are rendered as
//! plain blocks, so a `set` inside them leaks to the enclosing scope.

use std::borrow::Cow;
use std::fmt::{self, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use minijinja::value::{Kwargs, Object, ObjectExt, ObjectRepr, Value, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, UndefinedBehavior};
use serde_json::{Map, Value as JsonValue};
use sha2::{Digest, Sha256};

/// Name under which the one template lives in its environment; it shows in error
/// locations (`in chat_template:12`), whose line numbers count from the template's start.
const TEMPLATE_NAME: &str = "chat_template";

/// The special-token attributes transformers passes to every template render.
const SPECIAL_TOKEN_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// Why a template or tokenizer could not be loaded or applied.
///
/// `Load` and `NoTemplate` are configuration errors (the run cannot start); the others
/// concern one row's content, see [`TemplateError::is_row_error`].
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// A template or tokenizer file could not be read, parsed or compiled.
    #[error("cannot load {}: {detail}", path.display())]
    Load {
        /// The file that failed.
        path: PathBuf,
        /// What went wrong.
        detail: String,
    },
    /// Rendering failed (a Jinja error: bad operation, undefined attribute, bad input).
    #[error("chat template {}: {detail}", template.display())]
    Render {
        /// The template file.
        template: PathBuf,
        /// The Jinja error, with its line in the template.
        detail: String,
    },
    /// The template refused the messages through `raise_exception(message)`.
    #[error("chat template {} rejected the messages: {message}", template.display())]
    Raised {
        /// The template file.
        template: PathBuf,
        /// The template's own message (such as "Conversation roles must alternate").
        message: String,
    },
    /// The tokenizer failed to encode or decode (the detail names the tokenizer file).
    #[error("tokenizer: {detail}")]
    Tokenize {
        /// What went wrong, starting with the tokenizer file.
        detail: String,
    },
    /// A `messages` row needs a chat template and none is configured.
    #[error("a `messages` row needs a chat template, and none is configured")]
    NoTemplate,
}

impl TemplateError {
    /// True when the error is about one row's content (reject the row, go on), false when
    /// it is about the configuration (stop).
    pub fn is_row_error(&self) -> bool {
        matches!(
            self,
            Self::Render { .. } | Self::Raised { .. } | Self::Tokenize { .. }
        )
    }
}

fn load_error(path: &Path, detail: impl fmt::Display) -> TemplateError {
    TemplateError::Load {
        path: path.to_path_buf(),
        detail: detail.to_string(),
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let mut out = String::with_capacity(64);
    for byte in digest {
        // Writing to a String cannot fail.
        let _ = write!(out, "{byte:02x}");
    }
    out
}

// ---------------------------------------------------------------------------------------
// Chat template
// ---------------------------------------------------------------------------------------

/// A HuggingFace chat template, rendered with transformers' `apply_chat_template`
/// semantics, so the prompt sent is byte for byte what the model was trained on.
#[derive(Clone)]
pub struct ChatTemplate {
    inner: Arc<TemplateInner>,
}

struct TemplateInner {
    env: Environment<'static>,
    source: String,
    sha256: String,
    /// Special tokens as plain strings, in the order read.
    special_tokens: Map<String, JsonValue>,
    origin: PathBuf,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.inner.origin)
            .field("sha256", &self.inner.sha256)
            .field("special_tokens", &self.inner.special_tokens)
            .finish()
    }
}

impl ChatTemplate {
    /// Loads a template from `tokenizer_config.json` (or any `.json` file with a
    /// `chat_template` key) or from a template file such as `chat_template.jinja`.
    ///
    /// For JSON, `chat_template` is a string or a list of `{name, template}` of which the
    /// one named `default` is taken; a config without one falls back to a
    /// `chat_template.jinja` next to it (how newer HF repositories ship templates). Its
    /// special tokens (strings or `{"content": ..}` objects) become template variables.
    /// Any other file is the template itself; the special tokens then come from a
    /// `tokenizer_config.json` next to it when there is one, else there are none.
    pub fn from_file(path: &Path) -> Result<Self, TemplateError> {
        let text = read_text(path)?;
        let is_json = path
            .extension()
            .is_some_and(|ext| ext.eq_ignore_ascii_case("json"));
        if !is_json {
            let tokens = sibling_special_tokens(path);
            return Self::from_source(&text, tokens, path.to_path_buf());
        }
        let config: JsonValue = serde_json::from_str(&text)
            .map_err(|e| load_error(path, format!("not valid JSON: {e}")))?;
        let Some(config) = config.as_object() else {
            return Err(load_error(path, "not a JSON object"));
        };
        let tokens = special_tokens_from_config(config);
        match config.get("chat_template") {
            Some(JsonValue::String(source)) => {
                Self::from_source(source, tokens, path.to_path_buf())
            }
            Some(JsonValue::Array(list)) => {
                let source = default_named_template(list).map_err(|e| load_error(path, e))?;
                Self::from_source(source, tokens, path.to_path_buf())
            }
            Some(JsonValue::Null) | None => {
                let jinja = path.with_file_name("chat_template.jinja");
                if jinja.is_file() {
                    let source = read_text(&jinja)?;
                    Self::from_source(&source, tokens, jinja)
                } else {
                    Err(load_error(
                        path,
                        "no `chat_template` key, and no chat_template.jinja next to it",
                    ))
                }
            }
            Some(other) => Err(load_error(
                path,
                format!(
                    "`chat_template` must be a string or a list of {{name, template}}, not {}",
                    json_kind(other)
                ),
            )),
        }
    }

    /// Builds a template from its source. `special_tokens` become top-level variables
    /// (strings, or `{"content": ..}` objects; nulls are dropped); `origin` is the file
    /// named in errors. Fails when the source does not compile.
    pub fn from_source(
        source: &str,
        special_tokens: Map<String, JsonValue>,
        origin: PathBuf,
    ) -> Result<Self, TemplateError> {
        let special_tokens: Map<String, JsonValue> = special_tokens
            .into_iter()
            .filter_map(|(key, value)| token_text(&value).map(|t| (key, JsonValue::String(t))))
            .collect();
        let mut env = new_environment();
        let compiled = rewrite_generation_tags(source).into_owned();
        env.add_template_owned(TEMPLATE_NAME, compiled)
            .map_err(|e| {
                load_error(
                    &origin,
                    format!("invalid chat template: {}", error_chain(&e)),
                )
            })?;
        Ok(Self {
            inner: Arc::new(TemplateInner {
                env,
                sha256: sha256_hex(source.as_bytes()),
                source: source.to_owned(),
                special_tokens,
                origin,
            }),
        })
    }

    /// Renders `messages` (an OpenAI messages array) as transformers does, with
    /// `add_generation_prompt` and `extra` top-level variables (`tools`,
    /// `enable_thinking`, …). Errors name the template file.
    ///
    /// Variables: the special tokens, then `tools = documents = none`, then `extra`
    /// (which overrides them), then `messages` and `add_generation_prompt`. Keys whose
    /// value is `null` are dropped from each message, as transformers ≥ 5 does.
    pub fn render(
        &self,
        messages: &JsonValue,
        add_generation_prompt: bool,
        extra: &Map<String, JsonValue>,
    ) -> Result<String, TemplateError> {
        let inner = &self.inner;
        let JsonValue::Array(list) = messages else {
            return Err(TemplateError::Render {
                template: inner.origin.clone(),
                detail: format!("messages must be a JSON array, not {}", json_kind(messages)),
            });
        };
        let messages: Vec<Value> = list.iter().map(message_to_value).collect();

        let mut ctx = OrderedMap::default();
        for (key, value) in &inner.special_tokens {
            ctx.insert(key.as_str(), json_to_value(value));
        }
        ctx.insert("tools", Value::from(()));
        ctx.insert("documents", Value::from(()));
        for (key, value) in extra {
            ctx.insert(key.as_str(), json_to_value(value));
        }
        ctx.insert("messages", Value::from(messages));
        ctx.insert("add_generation_prompt", Value::from(add_generation_prompt));

        let template = inner
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| self.render_error(&e))?;
        template
            .render(Value::from_object(ctx))
            .map_err(|e| self.render_error(&e))
    }

    fn render_error(&self, err: &Error) -> TemplateError {
        let template = self.inner.origin.clone();
        match raised_message(err) {
            Some(message) => TemplateError::Raised { template, message },
            None => TemplateError::Render {
                template,
                detail: error_chain(err),
            },
        }
    }

    /// Hex sha256 of the template source, recorded so outputs say which template made them.
    pub fn sha256(&self) -> String {
        self.inner.sha256.clone()
    }

    /// The template source as loaded (before any internal rewriting).
    pub fn source(&self) -> &str {
        &self.inner.source
    }

    /// The file the template came from, as named in errors.
    pub fn origin(&self) -> &Path {
        &self.inner.origin
    }

    /// The special tokens passed to the template (all values are strings).
    pub fn special_tokens(&self) -> &Map<String, JsonValue> {
        &self.inner.special_tokens
    }

    /// The `bos_token` text the template sees, if any.
    pub fn bos_token(&self) -> Option<&str> {
        self.inner
            .special_tokens
            .get("bos_token")
            .and_then(JsonValue::as_str)
    }
}

fn read_text(path: &Path) -> Result<String, TemplateError> {
    let text = std::fs::read_to_string(path).map_err(|e| load_error(path, e))?;
    // A UTF-8 BOM is an editor artefact, not template text.
    Ok(match text.strip_prefix('\u{feff}') {
        Some(rest) => rest.to_owned(),
        None => text,
    })
}

fn json_kind(value: &JsonValue) -> &'static str {
    match value {
        JsonValue::Null => "null",
        JsonValue::Bool(_) => "a boolean",
        JsonValue::Number(_) => "a number",
        JsonValue::String(_) => "a string",
        JsonValue::Array(_) => "an array",
        JsonValue::Object(_) => "an object",
    }
}

/// A special token's text: a plain string or an AddedToken object `{"content": ..}`.
fn token_text(value: &JsonValue) -> Option<String> {
    match value {
        JsonValue::String(s) => Some(s.clone()),
        JsonValue::Object(obj) => obj.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

fn special_tokens_from_config(config: &Map<String, JsonValue>) -> Map<String, JsonValue> {
    SPECIAL_TOKEN_KEYS
        .iter()
        .filter_map(|key| {
            let text = token_text(config.get(*key)?)?;
            Some(((*key).to_owned(), JsonValue::String(text)))
        })
        .collect()
}

/// Special tokens of the `tokenizer_config.json` next to a template file, if readable.
fn sibling_special_tokens(template: &Path) -> Map<String, JsonValue> {
    let config_path = template.with_file_name("tokenizer_config.json");
    let Ok(text) = std::fs::read_to_string(&config_path) else {
        return Map::new();
    };
    match serde_json::from_str::<JsonValue>(text.trim_start_matches('\u{feff}')) {
        Ok(JsonValue::Object(config)) => {
            tracing::debug!(config = %config_path.display(), "special tokens for the chat template");
            special_tokens_from_config(&config)
        }
        _ => {
            tracing::warn!(
                config = %config_path.display(),
                "ignoring unreadable tokenizer_config.json next to the chat template"
            );
            Map::new()
        }
    }
}

fn default_named_template(list: &[JsonValue]) -> Result<&str, String> {
    let mut names = Vec::new();
    for entry in list {
        let name = entry.get("name").and_then(JsonValue::as_str);
        let template = entry.get("template").and_then(JsonValue::as_str);
        match (name, template) {
            (Some("default"), Some(template)) => return Ok(template),
            (Some(name), Some(_)) => names.push(name.to_owned()),
            _ => {
                return Err("`chat_template` list entries must be {name, template} strings".into())
            }
        }
    }
    Err(format!(
        "`chat_template` lists no template named \"default\" (found: {})",
        names.join(", ")
    ))
}

/// The Jinja environment transformers renders in (see the module docs).
fn new_environment() -> Environment<'static> {
    let mut env = Environment::new();
    // The default delimiters always build; fall back to the defaults all the same.
    if let Ok(syntax) = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .keep_trailing_newline(false)
        .build()
    {
        env.set_syntax(syntax);
    }
    env.set_undefined_behavior(UndefinedBehavior::Lenient);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_debug(false);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(|out, _state, value| out.write_str(&py_str(value)).map_err(Error::from));
    env.add_filter("tojson", tojson_filter);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", strftime_now);
    env
}

/// Rewrites transformers' `{% generation %}…{% endgeneration %}` (an assistant-mask
/// extension that only records spans) as `{% if true %}…{% endif %}`, keeping any
/// whitespace-control modifiers, so such templates compile and render the same text.
fn rewrite_generation_tags(source: &str) -> Cow<'_, str> {
    if !source.contains("generation") {
        return Cow::Borrowed(source);
    }
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        match generation_tag(tag) {
            Some((len, replacement)) => {
                out.push_str(&replacement);
                rest = &tag[len..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    Cow::Owned(out)
}

/// If `tag` (starting with `{%`) is a generation tag: its length and replacement.
fn generation_tag(tag: &str) -> Option<(usize, String)> {
    let bytes = tag.as_bytes();
    let modifier = |i: usize| match bytes.get(i) {
        Some(b'-') => "-",
        Some(b'+') => "+",
        _ => "",
    };
    let skip_ws = |mut i: usize| {
        while bytes.get(i).is_some_and(u8::is_ascii_whitespace) {
            i += 1;
        }
        i
    };
    let open = modifier(2);
    let mut i = skip_ws(2 + open.len());
    // Only ASCII was skipped, so `i` is a char boundary.
    let body = &tag[i..];
    let (keyword, replacement) = if body.starts_with("endgeneration") {
        ("endgeneration", "endif")
    } else if body.starts_with("generation") {
        ("generation", "if true")
    } else {
        return None;
    };
    i = skip_ws(i + keyword.len());
    let close = modifier(i);
    i += close.len();
    if !tag[i..].starts_with("%}") {
        return None;
    }
    Some((i + 2, format!("{{%{open} {replacement} {close}%}}")))
}

/// Carried as the source of the error `raise_exception` returns, so a render failure can
/// be told apart from a template bug.
#[derive(Debug)]
struct RaisedException(String);

impl fmt::Display for RaisedException {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

/// transformers' `raise_exception(message)` global.
fn raise_exception(message: Value) -> Result<Value, Error> {
    let message = py_str(&message);
    Err(Error::new(ErrorKind::InvalidOperation, message.clone())
        .with_source(RaisedException(message)))
}

fn raised_message(err: &Error) -> Option<String> {
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = current {
        if let Some(raised) = e.downcast_ref::<RaisedException>() {
            return Some(raised.0.clone());
        }
        current = e.source();
    }
    None
}

/// An error and its causes on one line.
fn error_chain(err: &Error) -> String {
    let mut out = err.to_string();
    let mut current = std::error::Error::source(err);
    while let Some(e) = current {
        let _ = write!(out, ": {e}");
        current = e.source();
    }
    out
}

/// transformers' `strftime_now(format)`: `datetime.now().strftime(format)` in local time.
#[cfg(unix)]
fn strftime_now(format: &str) -> Result<Value, Error> {
    let c_format = std::ffi::CString::new(format).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            "strftime_now: the format contains a NUL byte",
        )
    })?;
    // SAFETY: `time` accepts a null pointer and only returns the current time.
    let now = unsafe { libc::time(std::ptr::null_mut()) };
    // SAFETY: `tm` is plain data (integers and a nullable pointer); all-zero is valid.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are valid for the call; `localtime_r` is the re-entrant form.
    if unsafe { libc::localtime_r(&now, &mut tm) }.is_null() {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "strftime_now: cannot read the local time",
        ));
    }
    let mut buf = vec![0u8; 256];
    loop {
        // SAFETY: `buf` is writable for `buf.len()` bytes, `c_format` is NUL-terminated
        // and `tm` was filled by `localtime_r`; strftime writes at most `buf.len()` bytes.
        let written = unsafe {
            libc::strftime(
                buf.as_mut_ptr().cast::<libc::c_char>(),
                buf.len(),
                c_format.as_ptr(),
                &tm,
            )
        };
        // 0 means "empty result" or "buffer too small": grow a few times, then accept.
        if written > 0 || buf.len() >= 1 << 16 {
            buf.truncate(written);
            return Ok(Value::from(String::from_utf8_lossy(&buf).into_owned()));
        }
        buf.resize(buf.len() * 4, 0);
    }
}

/// transformers' `strftime_now(format)`; only implemented on unix.
#[cfg(not(unix))]
fn strftime_now(_format: &str) -> Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        "strftime_now is only supported on unix",
    ))
}

// ---------------------------------------------------------------------------------------
// JSON values in templates: ordered maps
// ---------------------------------------------------------------------------------------

/// A map that keeps insertion order (minijinja's own maps sort their keys unless built
/// with `preserve_order`), so `tojson` and `.items()` see keys in the order written.
#[derive(Debug, Default)]
struct OrderedMap {
    entries: Vec<(Value, Value)>,
}

impl OrderedMap {
    /// Inserts or replaces `key`, keeping the position of the first insertion.
    fn insert(&mut self, key: &str, value: Value) {
        match self
            .entries
            .iter_mut()
            .find(|(k, _)| k.as_str() == Some(key))
        {
            Some(entry) => entry.1 = value,
            None => self.entries.push((Value::from(key), value)),
        }
    }
}

impl Object for OrderedMap {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Map
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let key = key.as_str()?;
        self.entries
            .iter()
            .find(|(k, _)| k.as_str() == Some(key))
            .map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> minijinja::value::Enumerator {
        self.mapped_key_value_enumerator(|this| {
            Box::new(this.entries.iter().map(|(k, v)| (k.clone(), v.clone())))
        })
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.entries.len())
    }

    fn render(self: &Arc<Self>, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&py_repr(&Value::from_dyn_object(self.clone())))
    }
}

/// A JSON value as a template value (objects keep their key order).
fn json_to_value(value: &JsonValue) -> Value {
    match value {
        JsonValue::Null => Value::from(()),
        JsonValue::Bool(b) => Value::from(*b),
        JsonValue::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        JsonValue::String(s) => Value::from(s.as_str()),
        JsonValue::Array(items) => Value::from(items.iter().map(json_to_value).collect::<Vec<_>>()),
        JsonValue::Object(map) => {
            let entries = map
                .iter()
                .map(|(k, v)| (Value::from(k.as_str()), json_to_value(v)))
                .collect();
            Value::from_object(OrderedMap { entries })
        }
    }
}

/// A message as a template value: like [`json_to_value`], minus null-valued keys.
fn message_to_value(message: &JsonValue) -> Value {
    match message {
        JsonValue::Object(map) => {
            let entries = map
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (Value::from(k.as_str()), json_to_value(v)))
                .collect();
            Value::from_object(OrderedMap { entries })
        }
        other => json_to_value(other),
    }
}

// ---------------------------------------------------------------------------------------
// Python formatting: str(), repr() and json.dumps()
// ---------------------------------------------------------------------------------------

/// Python's `repr(float)` (shortest round-trip digits, exponent outside 1e-4..1e16).
fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf".into() } else { "-inf".into() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    let sign = if f < 0.0 { "-" } else { "" };
    // `{:e}` gives the shortest round-trip digits, e.g. "1.2345e6" or "1e-7".
    let sci = format!("{:e}", f.abs());
    let Some((mantissa, exp)) = sci.split_once('e') else {
        return f.to_string();
    };
    let Ok(exp) = exp.parse::<i32>() else {
        return f.to_string();
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let n = digits.len() as i32;
    let decpt = exp + 1;
    if decpt <= -4 || decpt > 16 {
        let mantissa = if n == 1 {
            digits
        } else {
            format!("{}.{}", &digits[..1], &digits[1..])
        };
        let exp_sign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{exp_sign}{:02}", exp.abs())
    } else if decpt <= 0 {
        format!("{sign}0.{}{digits}", "0".repeat((-decpt) as usize))
    } else if decpt >= n {
        format!("{sign}{digits}{}.0", "0".repeat((decpt - n) as usize))
    } else {
        let (int, frac) = digits.split_at(decpt as usize);
        format!("{sign}{int}.{frac}")
    }
}

fn py_number(value: &Value) -> String {
    if value.is_integer() {
        value.to_string()
    } else {
        match f64::try_from(value.clone()) {
            Ok(f) => py_float_repr(f),
            Err(_) => value.to_string(),
        }
    }
}

/// Python's `str(value)`: what `{{ value }}` prints in jinja2.
fn py_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => value.as_str().unwrap_or_default().to_owned(),
        _ => py_repr(value),
    }
}

/// Python's `repr(value)` (strings quoted), as containers print their items.
fn py_repr(value: &Value) -> String {
    let mut out = String::new();
    write_py_repr(&mut out, value);
    out
}

fn write_py_repr(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push_str(&py_number(value)),
        ValueKind::String => write_py_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => match value.try_iter() {
            Ok(items) => {
                out.push('[');
                for (i, item) in items.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_py_repr(out, &item);
                }
                out.push(']');
            }
            Err(_) => out.push_str(&value.to_string()),
        },
        ValueKind::Map => match value.try_iter() {
            Ok(keys) => {
                out.push('{');
                for (i, key) in keys.enumerate() {
                    if i > 0 {
                        out.push_str(", ");
                    }
                    write_py_repr(out, &key);
                    out.push_str(": ");
                    write_py_repr(out, &value.get_item(&key).unwrap_or_default());
                }
                out.push('}');
            }
            Err(_) => out.push_str(&value.to_string()),
        },
        _ => out.push_str(&value.to_string()),
    }
}

/// Whether Python's `str.isprintable()` is false for `c` (approximated for the
/// categories that matter in prompts: controls, format characters, odd spaces).
fn py_unprintable(c: char) -> bool {
    matches!(c,
        '\0'..='\x1f' | '\x7f'..='\u{a0}' | '\u{ad}' | '\u{1680}' | '\u{2000}'..='\u{200f}'
        | '\u{2028}'..='\u{202f}' | '\u{205f}'..='\u{2064}' | '\u{3000}' | '\u{feff}'
        | '\u{e000}'..='\u{f8ff}')
}

fn write_py_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if py_unprintable(c) => {
                let code = c as u32;
                let _ = if code < 0x100 {
                    write!(out, "\\x{code:02x}")
                } else {
                    write!(out, "\\u{code:04x}")
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Options of Python's `json.dumps`, as transformers' `tojson` passes them.
struct JsonStyle {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

impl Default for JsonStyle {
    fn default() -> Self {
        Self {
            ensure_ascii: false,
            indent: None,
            item_sep: ", ".into(),
            key_sep: ": ".into(),
            sort_keys: false,
        }
    }
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)` filter, i.e. Python's `json.dumps` with those arguments
/// (`sort_keys` only by keyword: minijinja filters take at most five arguments).
fn tojson_filter(
    value: &Value,
    ensure_ascii: Option<Value>,
    indent: Option<Value>,
    separators: Option<Value>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let pick = |positional: Option<Value>, name: &str| -> Result<Option<Value>, Error> {
        let named: Option<Value> = kwargs.get(name)?;
        Ok(named
            .or(positional)
            .filter(|v| !v.is_none() && !v.is_undefined()))
    };
    let ensure_ascii = pick(ensure_ascii, "ensure_ascii")?;
    let indent = pick(indent, "indent")?;
    let separators = pick(separators, "separators")?;
    let sort_keys = pick(None, "sort_keys")?;
    kwargs.assert_all_used()?;

    let mut style = JsonStyle {
        ensure_ascii: ensure_ascii.is_some_and(|v| v.is_true()),
        sort_keys: sort_keys.is_some_and(|v| v.is_true()),
        ..JsonStyle::default()
    };
    if let Some(indent) = indent {
        style.indent = Some(match indent.as_str() {
            Some(s) => s.to_owned(),
            None => {
                let n = indent.as_i64().ok_or_else(|| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be an integer or a string",
                    )
                })?;
                " ".repeat(n.max(0) as usize)
            }
        });
        // Python's default item separator is "," once indent is set.
        style.item_sep = ",".into();
    }
    if let Some(separators) = separators {
        let parts: Vec<Value> = separators.try_iter()?.collect();
        match parts.as_slice() {
            [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                style.item_sep = item.as_str().unwrap_or_default().to_owned();
                style.key_sep = key.as_str().unwrap_or_default().to_owned();
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be a pair of strings",
                ))
            }
        }
    }
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(Value::from(out))
}

fn write_json_newline(out: &mut String, style: &JsonStyle, level: usize) {
    if let Some(indent) = &style.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(indent);
        }
    }
}

fn write_json(
    out: &mut String,
    value: &Value,
    style: &JsonStyle,
    level: usize,
) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                out.push_str(&value.to_string());
            } else {
                let f = f64::try_from(value.clone())?;
                out.push_str(&match f {
                    f if f.is_nan() => "NaN".to_owned(),
                    f if f.is_infinite() && f > 0.0 => "Infinity".to_owned(),
                    f if f.is_infinite() => "-Infinity".to_owned(),
                    f => py_float_repr(f),
                });
            }
        }
        ValueKind::String => {
            write_json_str(out, value.as_str().unwrap_or_default(), style.ensure_ascii)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                write_json_newline(out, style, level + 1);
                write_json(out, item, style, level + 1)?;
            }
            write_json_newline(out, style, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                write_json_newline(out, style, level + 1);
                write_json_str(out, key, style.ensure_ascii);
                out.push_str(&style.key_sep);
                write_json(out, item, style, level + 1)?;
            }
            write_json_newline(out, style, level);
            out.push('}');
        }
        kind => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: object of type {kind} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

/// A map key as Python's json module writes it (non-string keys are converted).
fn json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::Number | ValueKind::Bool | ValueKind::None => {
            let mut out = String::new();
            write_json(&mut out, key, &JsonStyle::default(), 0)?;
            Ok(out)
        }
        kind => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
        )),
    }
}

fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

// ---------------------------------------------------------------------------------------
// Tokenizer
// ---------------------------------------------------------------------------------------

/// A HuggingFace `tokenizer.json`, giving the ids sent to the server and the token
/// counts budgets rely on. Cheap to clone; `Send + Sync`.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    sha256: Arc<str>,
    origin: Arc<Path>,
    /// Text of the tokens `encode(_, true)` puts before the text (e.g. `<s>`); empty
    /// when the post-processor adds none.
    prefix_text: Arc<str>,
    /// The same tokenizer without its normaliser, when that normaliser is exactly NFC.
    /// Text that is already NFC is its own normal form, so this gives the same ids while
    /// skipping the per-character alignment bookkeeping (5–15 % of encode time).
    nfc_bypass: Option<Arc<tokenizers::Tokenizer>>,
    /// The exact fast encoder, when `tokenizer.json` is a byte-level BPE of the
    /// GPT-4/Qwen2 shape (see [`crate::prompt::byte_bpe`]); text it cannot take (not NFC under an
    /// NFC normaliser) still goes through `tokenizers`.
    fast: Option<Arc<crate::prompt::byte_bpe::ByteBpe>>,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("origin", &self.origin)
            .field("sha256", &self.sha256)
            .field("prefix_text", &self.prefix_text)
            .finish()
    }
}

/// Benchmarks only (`make bench-tokenize`): set, the NFC bypass is off, so its gain can
/// be measured on one binary.
pub const NO_NFC_BYPASS_ENV: &str = "SPOOL_BENCH_NO_NFC_BYPASS";

/// Benchmarks only (`make bench-tokenize`): set, the fast byte-level BPE encoder is off
/// and every text goes through `tokenizers`, so its gain can be measured on one binary.
pub const NO_FAST_BPE_ENV: &str = "SPOOL_BENCH_NO_FAST_BPE";

impl Tokenizer {
    /// Loads `tokenizer.json`; errors name the file.
    pub fn from_file(path: &Path) -> Result<Self, TemplateError> {
        let bytes = std::fs::read(path).map_err(|e| load_error(path, e))?;
        Self::from_bytes(&bytes, path.to_path_buf())
    }

    /// Builds a tokenizer from `tokenizer.json` bytes; `origin` is the file named in errors.
    pub fn from_bytes(bytes: &[u8], origin: PathBuf) -> Result<Self, TemplateError> {
        let mut inner = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| load_error(&origin, format!("not a valid tokenizer.json: {e}")))?;
        // Counts must be true counts: never truncate or pad.
        inner
            .with_truncation(None)
            .map_err(|e| load_error(&origin, e))?;
        inner.with_padding(None);
        let prefix_text = special_prefix_text(&inner).map_err(|e| load_error(&origin, e))?;
        let nfc_bypass = match inner.get_normalizer() {
            Some(tokenizers::NormalizerWrapper::NFC(_))
                if std::env::var_os(NO_NFC_BYPASS_ENV).is_none() =>
            {
                let mut bare = inner.clone();
                bare.with_normalizer(None::<tokenizers::NormalizerWrapper>)
                    .map_err(|e| load_error(&origin, e))?;
                Some(Arc::new(bare))
            }
            _ => None,
        };
        let fast = if std::env::var_os(NO_FAST_BPE_ENV).is_some() {
            None
        } else {
            Self::fast_encoder(bytes, &inner, &origin)
        };
        Ok(Self {
            inner: Arc::new(inner),
            nfc_bypass,
            fast,
            sha256: sha256_hex(bytes).into(),
            origin: origin.into(),
            prefix_text: prefix_text.into(),
        })
    }

    /// The fast encoder for this file, or `None` (logged) when it is not of the supported
    /// shape; never an error: `tokenizers` then does all the encoding.
    fn fast_encoder(
        bytes: &[u8],
        inner: &tokenizers::Tokenizer,
        origin: &Path,
    ) -> Option<Arc<crate::prompt::byte_bpe::ByteBpe>> {
        let json: JsonValue = serde_json::from_slice(bytes).ok()?;
        match crate::prompt::byte_bpe::ByteBpe::new(&json, inner) {
            Ok(fast) => {
                tracing::debug!(tokenizer = %origin.display(), "fast byte-level BPE encoder on");
                Some(Arc::new(fast))
            }
            Err(why) => {
                tracing::debug!(tokenizer = %origin.display(), %why, "fast encoder off");
                None
            }
        }
    }

    /// Whether the fast byte-level BPE encoder is in use (see [`crate::prompt::byte_bpe`]).
    pub fn has_fast_encoder(&self) -> bool {
        self.fast.is_some()
    }

    fn error(&self, what: &str, err: impl fmt::Display) -> TemplateError {
        TemplateError::Tokenize {
            detail: format!("{}: {what}: {err}", self.origin.display()),
        }
    }

    /// Token ids of `text`; `add_special_tokens` runs the post-processor (BOS/EOS as
    /// `tokenizer.json` defines them). Special-token text inside `text` is matched as
    /// special tokens, the `tokenizers` default.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TemplateError> {
        use unicode_normalization_alignments::{is_nfc_quick, IsNormalized};
        if let Some(fast) = &self.fast {
            if !fast.needs_nfc() || is_nfc_quick(text.chars()) == IsNormalized::Yes {
                return Ok(fast.encode(text));
            }
        }
        let tokenizer = match &self.nfc_bypass {
            Some(bare) if is_nfc_quick(text.chars()) == IsNormalized::Yes => bare,
            _ => &self.inner,
        };
        tokenizer
            .encode_fast(text, add_special_tokens)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|e| self.error("cannot encode", e))
    }

    /// Ids of a raw `prompt` row: with special tokens, unless the text already starts
    /// with the tokens the tokenizer would prepend (no double BOS).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TemplateError> {
        let has_prefix = !self.prefix_text.is_empty() && text.starts_with(&*self.prefix_text);
        self.encode(text, !has_prefix)
    }

    /// Text of `ids`, special tokens included (the exact completion the model wrote).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TemplateError> {
        self.inner
            .decode(ids, false)
            .map_err(|e| self.error("cannot decode", e))
    }

    /// Number of tokens in `text`, without special tokens.
    pub fn count(&self, text: &str) -> Result<usize, TemplateError> {
        self.encode(text, false).map(|ids| ids.len())
    }

    /// Hex sha256 of the `tokenizer.json` bytes (goes into shard metadata).
    pub fn sha256(&self) -> &str {
        &self.sha256
    }

    /// The file the tokenizer came from.
    pub fn origin(&self) -> &Path {
        &self.origin
    }

    /// Text of the tokens `encode(_, true)` prepends (such as `<s>`); empty if none.
    pub fn special_prefix(&self) -> &str {
        &self.prefix_text
    }

    /// The id of a token (such as `<|im_end|>`), if the vocabulary has it.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}

/// The text of the tokens the post-processor puts before a single sequence, found by
/// encoding a probe with and without special tokens.
fn special_prefix_text(tokenizer: &tokenizers::Tokenizer) -> Result<String, String> {
    let probe = "a";
    let plain = tokenizer
        .encode_fast(probe, false)
        .map_err(|e| format!("cannot encode a probe: {e}"))?;
    let full = tokenizer
        .encode_fast(probe, true)
        .map_err(|e| format!("cannot encode a probe: {e}"))?;
    let (plain, full) = (plain.get_ids(), full.get_ids());
    let start = (0..=full.len().saturating_sub(plain.len()))
        .find(|&i| full[i..].starts_with(plain))
        .unwrap_or(0);
    Ok(full[..start]
        .iter()
        .filter_map(|&id| tokenizer.id_to_token(id))
        .collect())
}

// ---------------------------------------------------------------------------------------
// Prompt builder
// ---------------------------------------------------------------------------------------

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
        let template = self.template.as_ref().ok_or(TemplateError::NoTemplate)?;
        let text = template.render(messages, true, &self.template_kwargs)?;
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

    fn fixture(rel: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/tokenizers")
            .join(rel)
    }

    fn template(source: &str) -> ChatTemplate {
        ChatTemplate::from_source(source, Map::new(), PathBuf::from("test.jinja")).unwrap()
    }

    fn render_expr(expr: &str, vars: JsonValue) -> String {
        let extra = vars.as_object().cloned().unwrap_or_default();
        template(expr).render(&json!([]), false, &extra).unwrap()
    }

    /// Python's `json.dumps(value)` with the default options transformers uses.
    fn py_json_dumps(value: &Value) -> Result<String, Error> {
        let mut out = String::new();
        write_json(&mut out, value, &JsonStyle::default(), 0)?;
        Ok(out)
    }

    fn to_json(value: JsonValue) -> String {
        py_json_dumps(&json_to_value(&value)).unwrap()
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        assert_eq!(
            to_json(json!({"b": 1, "a": [true, null, 1.5, "x"]})),
            r#"{"b": 1, "a": [true, null, 1.5, "x"]}"#
        );
        // No HTML escaping, no ASCII escaping.
        assert_eq!(to_json(json!("< & ' > é 中 😀")), r#""< & ' > é 中 😀""#);
        // Controls escaped as Python does; DEL kept.
        assert_eq!(
            to_json(json!("q\"b\\n\n\r\t\u{8}\u{c}\u{1}\u{7f}")),
            "\"q\\\"b\\\\n\\n\\r\\t\\b\\f\\u0001\u{7f}\""
        );
        assert_eq!(to_json(json!([])), "[]");
        assert_eq!(to_json(json!({})), "{}");
        assert_eq!(
            to_json(json!({"z": {"y": {"x": []}}, "a": 0})),
            r#"{"z": {"y": {"x": []}}, "a": 0}"#
        );
        assert_eq!(to_json(json!(1e20)), "1e+20");
        assert_eq!(to_json(json!(-0.00001)), "-1e-05");
        assert_eq!(
            to_json(json!(12345678901234567890u64)),
            "12345678901234567890"
        );
    }

    #[test]
    fn tojson_filter_in_templates_keeps_key_order_and_options() {
        let vars = json!({"x": {"name": "f", "b": [1, 2], "a": {"é": "<&>"}}});
        assert_eq!(
            render_expr("{{ x | tojson }}", vars.clone()),
            r#"{"name": "f", "b": [1, 2], "a": {"é": "<&>"}}"#
        );
        assert_eq!(
            render_expr("{{ x | tojson(indent=2) }}", vars.clone()),
            "{\n  \"name\": \"f\",\n  \"b\": [\n    1,\n    2\n  ],\n  \"a\": {\n    \"é\": \"<&>\"\n  }\n}"
        );
        assert_eq!(
            render_expr(
                "{{ x | tojson(sort_keys=true, ensure_ascii=true) }}",
                vars.clone()
            ),
            r#"{"a": {"\u00e9": "<&>"}, "b": [1, 2], "name": "f"}"#
        );
        assert_eq!(
            render_expr("{{ x.b | tojson(separators=(',', ':')) }}", vars.clone()),
            "[1,2]"
        );
        assert_eq!(
            render_expr("{{ '😀' | tojson(ensure_ascii=true) }}", json!({})),
            r#""\ud83d\ude00""#
        );
        // `.items()` follows the JSON order too.
        assert_eq!(
            render_expr("{% for k, v in x.items() %}{{ k }};{% endfor %}", vars),
            "name;b;a;"
        );
    }

    #[test]
    fn values_print_like_python() {
        let vars = json!({"n": null, "t": true, "f": 1.0, "i": 3, "l": ["a", 1, null, false], "d": {"k": "it's"}});
        assert_eq!(
            render_expr("{{ n }}|{{ t }}|{{ f }}|{{ i }}|{{ nope }}", vars.clone()),
            "None|True|1.0|3|"
        );
        assert_eq!(
            render_expr("{{ l }} {{ d }}", vars),
            r#"['a', 1, None, False] {'k': "it's"}"#
        );
        assert_eq!(py_float_repr(0.1), "0.1");
        assert_eq!(py_float_repr(1e16), "1e+16");
        assert_eq!(py_float_repr(1234567890123456.0), "1234567890123456.0");
        assert_eq!(py_float_repr(0.0001), "0.0001");
        assert_eq!(py_float_repr(-2.5e-7), "-2.5e-07");
    }

    #[test]
    fn jinja_settings_match_transformers() {
        // trim_blocks + lstrip_blocks, loop controls, pycompat methods, slicing, namespace.
        let src = "{% for m in messages[::-1] %}\n  {% if loop.index > 2 %}{% break %}{% endif %}\n{{ m.content.strip() }}|{% endfor %}\n{% set ns = namespace(x=1) %}{% set ns.x = ns.x + 1 %}{{ ns.x }}\n";
        let out = template(src)
            .render(&json!([{"role": "user", "content": " a "}, {"role": "user", "content": "b"}, {"role": "user", "content": "c "}]), false, &Map::new())
            .unwrap();
        assert_eq!(out, "c|b|2");
        let src = "{{ 'abc'.startswith('a') }} {{ 'a,b'.split(',') }} {{ 'xx'.rstrip('x') == '' }} {{ tools is none }} {{ enable_thinking is defined }}";
        assert_eq!(
            render_expr(src, json!({})),
            "True ['a', 'b'] True True False"
        );
    }

    #[test]
    fn raise_exception_names_the_file() {
        let t = ChatTemplate::from_source(
            "{% if messages[0].role != 'user' %}{{ raise_exception('Roles must alternate') }}{% endif %}ok",
            Map::new(),
            PathBuf::from("/models/x/tokenizer_config.json"),
        )
        .unwrap();
        assert_eq!(
            t.render(&json!([{"role": "user"}]), false, &Map::new())
                .unwrap(),
            "ok"
        );
        let err = t
            .render(&json!([{"role": "system"}]), false, &Map::new())
            .unwrap_err();
        match &err {
            TemplateError::Raised { template, message } => {
                assert_eq!(template, Path::new("/models/x/tokenizer_config.json"));
                assert_eq!(message, "Roles must alternate");
            }
            other => panic!("expected Raised, got {other:?}"),
        }
        assert!(err.is_row_error());
        let text = err.to_string();
        assert!(
            text.contains("/models/x/tokenizer_config.json")
                && text.contains("Roles must alternate"),
            "{text}"
        );

        // Other render errors are Render, also naming the file.
        let err = t.render(&json!([]), false, &Map::new()).unwrap_err();
        assert!(matches!(err, TemplateError::Render { .. }), "{err:?}");
        assert!(err.to_string().contains("tokenizer_config.json"));
        let err = t
            .render(&json!({"role": "user"}), false, &Map::new())
            .unwrap_err();
        assert!(matches!(err, TemplateError::Render { .. }), "{err:?}");
    }

    #[test]
    fn syntax_errors_are_load_errors_naming_the_file() {
        let err = ChatTemplate::from_source("{% if %}", Map::new(), PathBuf::from("bad.jinja"))
            .unwrap_err();
        assert!(matches!(err, TemplateError::Load { .. }));
        assert!(err.to_string().contains("bad.jinja"), "{err}");
        assert!(!err.is_row_error());
        let err =
            ChatTemplate::from_file(Path::new("/nonexistent/tokenizer_config.json")).unwrap_err();
        assert!(
            err.to_string()
                .contains("/nonexistent/tokenizer_config.json"),
            "{err}"
        );
        let err = Tokenizer::from_file(Path::new("/nonexistent/tokenizer.json")).unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/tokenizer.json"),
            "{err}"
        );
    }

    #[test]
    fn config_with_template_list_and_token_objects() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer_config.json");
        let config = json!({
            "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
            "eos_token": "</s>",
            "unk_token": null,
            "pad_token": {"content": "<pad>"},
            "chat_template": [
                {"name": "tool_use", "template": "TOOLS"},
                {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}|{{ unk_token is defined }}"}
            ]
        });
        std::fs::write(&path, serde_json::to_string(&config).unwrap()).unwrap();
        let t = ChatTemplate::from_file(&path).unwrap();
        assert_eq!(t.bos_token(), Some("<s>"));
        assert_eq!(
            JsonValue::Object(t.special_tokens().clone()),
            json!({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
        );
        assert_eq!(
            t.render(
                &json!([{"role": "user", "content": "hi"}]),
                true,
                &Map::new()
            )
            .unwrap(),
            "<s>hi</s>|False"
        );

        // No "default" in the list: an error naming the file and the names found.
        std::fs::write(
            &path,
            r#"{"chat_template": [{"name": "rag", "template": "x"}]}"#,
        )
        .unwrap();
        let err = ChatTemplate::from_file(&path).unwrap_err().to_string();
        assert!(
            err.contains("tokenizer_config.json") && err.contains("rag"),
            "{err}"
        );

        // No template at all, then a sibling chat_template.jinja.
        std::fs::write(&path, r#"{"eos_token": "</s>"}"#).unwrap();
        assert!(ChatTemplate::from_file(&path).is_err());
        std::fs::write(dir.path().join("chat_template.jinja"), "J{{ eos_token }}\n").unwrap();
        let t = ChatTemplate::from_file(&path).unwrap();
        assert_eq!(t.render(&json!([]), false, &Map::new()).unwrap(), "J</s>");
    }

    #[test]
    fn jinja_file_with_and_without_sibling_config() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("template.jinja");
        let source =
            "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ bos_token }}\n";
        std::fs::write(&path, source).unwrap();
        let t = ChatTemplate::from_file(&path).unwrap();
        assert!(t.special_tokens().is_empty());
        assert_eq!(t.sha256(), sha256_hex(source.as_bytes()));
        assert_eq!(t.source(), source);
        // The single trailing newline is dropped, as jinja2 does by default.
        assert_eq!(
            t.render(
                &json!([{"role": "user", "content": "x"}]),
                false,
                &Map::new()
            )
            .unwrap(),
            "[user]x"
        );
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"bos_token": "<s>"}"#,
        )
        .unwrap();
        let t = ChatTemplate::from_file(&path).unwrap();
        assert_eq!(t.render(&json!([]), false, &Map::new()).unwrap(), "<s>");
    }

    #[test]
    fn null_message_fields_are_dropped_and_extra_overrides() {
        let t = ChatTemplate::from_source(
            "{{ messages[0].tool_calls is defined }}|{{ eos_token }}|{{ tools | tojson }}",
            Map::from_iter([("eos_token".to_owned(), json!("E"))]),
            PathBuf::from("t.jinja"),
        )
        .unwrap();
        let extra = json!({"eos_token": "X", "tools": [{"b": 1, "a": 2}]});
        let out = t
            .render(
                &json!([{"role": "user", "content": "c", "tool_calls": null}]),
                false,
                extra.as_object().unwrap(),
            )
            .unwrap();
        assert_eq!(out, r#"False|X|[{"b": 1, "a": 2}]"#);
    }

    #[test]
    fn generation_tags_render_as_plain_blocks() {
        let src = "{% for m in messages %}{%- generation -%} {{ m.content }} {%- endgeneration %}\n{% endfor %}";
        let out = template(src)
            .render(&json!([{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]), false, &Map::new())
            .unwrap();
        assert_eq!(out, "ab");
        assert_eq!(
            rewrite_generation_tags("{% if generation %}"),
            "{% if generation %}"
        );
        assert_eq!(
            rewrite_generation_tags("{%+generation+%}"),
            "{%+ if true +%}"
        );
    }

    #[test]
    fn strftime_now_formats_the_current_date() {
        let out = render_expr(
            "{{ strftime_now('%Y-%m-%d') }}|{{ strftime_now('') }}",
            json!({}),
        );
        let (date, empty) = out.split_once('|').unwrap();
        assert_eq!(empty, "");
        assert_eq!(date.len(), 10, "{date}");
        assert!(date.starts_with("20"), "{date}");
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

    #[test]
    fn tokenizer_basics() {
        let tokenizer = Tokenizer::from_file(&fixture("qwen3/tokenizer.json")).unwrap();
        assert_eq!(tokenizer.special_prefix(), "");
        assert_eq!(
            tokenizer.sha256(),
            "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
        );
        let ids = tokenizer.encode("Hello!<|im_end|>", false).unwrap();
        assert_eq!(ids, vec![9707, 0, 151645]);
        assert_eq!(tokenizer.decode(&ids).unwrap(), "Hello!<|im_end|>");
        assert_eq!(tokenizer.count("Hello!").unwrap(), 2);
        assert_eq!(tokenizer.encode_prompt("Hello!").unwrap(), vec![9707, 0]);
        assert_eq!(tokenizer.token_to_id("<|im_end|>"), Some(151645));
    }

    /// The fast encoder is chosen for Qwen3 and not for Phi-3, and gives `tokenizers`' ids
    /// for NFC text, with and without special tokens.
    #[test]
    fn the_fast_encoder_gives_the_tokenizers_ids() {
        let tokenizer = Tokenizer::from_file(&fixture("qwen3/tokenizer.json")).unwrap();
        assert!(tokenizer.has_fast_encoder());
        let phi3 = Tokenizer::from_file(&fixture("phi3/tokenizer.json")).unwrap();
        assert!(!phi3.has_fast_encoder(), "Phi-3 is not byte-level BPE");
        // NFC text goes through the fast encoder, decomposed text through `tokenizers`
        // (which composes it): both must give the reference ids, with and without
        // special tokens.
        let texts = [
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nIt's   fine?\n\n",
            "Cafe\u{301} cre\u{300}me 中文 😀 ﬁ Ω Å 'LL 'ſ \u{a0}\u{3000} \r\n\t<think>x</think>",
            "def f(x):\n    return x ** 2  # ½ ²\n",
        ];
        for text in texts {
            for special in [false, true] {
                let want = tokenizer.inner.encode_fast(text, special).unwrap();
                assert_eq!(
                    tokenizer.encode(text, special).unwrap(),
                    want.get_ids(),
                    "{text:?}"
                );
            }
        }
    }

    /// The NFC bypass is exact: NFC text gives the full pipeline's ids, and text that is
    /// not NFC still goes through the normaliser (decomposed "é" tokenizes as composed).
    #[test]
    fn the_nfc_bypass_gives_the_normalisers_ids() {
        let tokenizer = Tokenizer::from_file(&fixture("qwen3/tokenizer.json")).unwrap();
        let bare = tokenizer
            .nfc_bypass
            .as_ref()
            .expect("qwen3 normalises with NFC");
        let texts = [
            "Hello, world! <|im_start|>user\nCafé 中文 😀 ﬁ Ω Å\n\n  x",
            "def f(x):\n    return x ** 2  # ½ ²\n",
        ];
        for text in texts {
            let full = tokenizer.inner.encode_fast(text, true).unwrap();
            assert_eq!(tokenizer.encode(text, true).unwrap(), full.get_ids());
            assert_eq!(
                bare.encode_fast(text, true).unwrap().get_ids(),
                full.get_ids()
            );
        }
        let decomposed = "Cafe\u{301} cre\u{300}me";
        let composed = "Caf\u{e9} cr\u{e8}me";
        assert_ne!(
            bare.encode_fast(decomposed, false).unwrap().get_ids(),
            tokenizer.encode(composed, false).unwrap()
        );
        assert_eq!(
            tokenizer.encode(decomposed, false).unwrap(),
            tokenizer.encode(composed, false).unwrap()
        );
    }

    #[test]
    fn shared_types_are_send_sync() {
        fn check<T: Send + Sync + Clone>() {}
        check::<ChatTemplate>();
        check::<Tokenizer>();
        check::<PromptBuilder>();
    }
}
