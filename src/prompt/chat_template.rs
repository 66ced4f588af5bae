//! A HuggingFace chat template, rendered as transformers' `apply_chat_template` renders it.
//!
//! Invariants:
//! - The environment is transformers' own: `trim_blocks`, `lstrip_blocks`, loop controls,
//!   no autoescape, jinja2's default undefined behaviour, and transformers' globals
//!   (`raise_exception`, `strftime_now`) and `tojson` (see [`super::python`]).
//! - The special tokens transformers passes (`bos_token`, `eos_token`, …) are top-level
//!   variables, and `tools` / `documents` are defined (as `none`) even when absent.
//! - Every error names the template file; `raise_exception` is its own variant
//!   ([`TemplateError::Raised`]) so callers can reject just that row.
//! - A template is `Send + Sync` and cheap to clone (shared through `Arc`).
//! - Messages reach the template as transformers' `apply_chat_template` passes them:
//!   null-valued keys dropped and the reasoning aliased to `thinking` and
//!   `reasoning_content` (see [`super::python`]); nothing else is changed.
//! - jinja2's semantics where minijinja's differ: dict literals keep their order
//!   (`preserve_order`), `none` is neither `iterable` nor a `sequence` (strings and dicts
//!   are both), values print as Python prints them (`~`, `|string`), and `str.title()`
//!   upper-cases after any non-letter. `tests/it/template_parity.rs` checks all of it against
//!   transformers on the frontier models' templates and a probe template.
//!
//! Known differences from jinja2. Failing loudly (the row is refused): `'…' % args` string
//! formatting, the `wordcount`, `center` and `truncate` filters and the rarer `str` methods
//! (`zfill`, …) are missing. Rendering differently: tuples print as lists (`(1, 2)` and
//! `d | items | list` show `[…]`). transformers' sandbox refuses `list.append`; minijinja
//! has no such method, so both refuse. `{% generation %}` blocks (transformers' assistant-mask extension) render as plain
//! blocks, so a `set` inside them leaks to the enclosing scope.
//!
//! Model code outside the template: transformers runs a model's own tokenizer class, and
//! only Moonshot's `tokenization_kimi.py` (named in `tokenizer_config.json` as
//! `auto_map.AutoTokenizer = tokenization_kimi.TikTokenTokenizer`) changes what the template
//! gets. spool reproduces its `apply_chat_template` override, in its two versions:
//! - K2, K2-Instruct, K2-Thinking: `tools` with every object's keys sorted, at every depth
//!   (`deep_sort_dict`).
//! - K2.5 / K2.6, recognised by a template that reads `tools_ts_str`: the sorted tools, and
//!   `tools_ts_str` = `encode_tools_to_typescript_style(tools)` of Moonshot's
//!   `tool_declaration_ts.py` ([`super::kimi_tools`]) whenever `tools` is non-empty. When the
//!   encoder fails (Python raises on schemas it cannot declare), `tools_ts_str` is left out and
//!   the template declares the tools as compact JSON, as the vendor code does; a successful
//!   encoding replaces any `tools_ts_str` the caller passed. The override's defaults apply:
//!   `thinking = true` and `preserve_thinking = false` are template variables unless the run's
//!   or the row's template variables (`chat_template_kwargs`, `kwargs`) set them. Its other defaults are moot here:
//!   `add_generation_prompt = True` is what spool always renders with, `tokenize = False` is
//!   how spool renders before encoding.
//!
//! A template that reads `tools_ts_str` without Moonshot's tokenizer named beside it refuses
//! rows with tools (unless the caller passes `tools_ts_str`): its declarations would depend on
//! tokenizer code spool cannot see.

use std::borrow::Cow;
use std::fmt::{self, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use minijinja::value::Value;
use minijinja::{AutoEscape, Environment, Error, ErrorKind, UndefinedBehavior};
use serde_json::{Map, Value as JsonValue};

use super::error::{load_error, TemplateError};
use super::kimi_tools::encode_tools_to_typescript_style;
use super::python::{
    is_iterable, is_sequence, json_to_value, json_truthy, message_to_value, py_str, tojson_filter,
    unknown_method, OrderedMap,
};
use super::sha256_hex;

/// Name under which the one template lives in its environment; it shows in error
/// locations (`in chat_template:12`), whose line numbers count from the template's start.
const TEMPLATE_NAME: &str = "chat_template";

/// The variable in which Kimi K2.5's `tokenization_kimi.py` passes tools as TypeScript
/// declarations (its `tool_declaration_ts.py`); its template prefers it to `tools`.
const TOOLS_TS_STR: &str = "tools_ts_str";

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
    /// What the model's own tokenizer code does before the template renders.
    model_code: ModelCode,
}

/// The Python-side rendering a model's `tokenization_*.py` adds to transformers' own, which
/// spool reproduces (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ModelCode {
    /// transformers' `apply_chat_template` as is.
    None,
    /// Moonshot's K2 `tokenization_kimi.py`: tool keys sorted at every depth.
    KimiSortedTools,
    /// Moonshot's K2.5 / K2.6 `tokenization_kimi.py`: tool keys sorted, `tools_ts_str`
    /// computed from them, `thinking = true` and `preserve_thinking = false` by default.
    KimiTypeScriptTools,
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
            let config = sibling_config(path);
            let tokens = special_tokens_from_config(&config);
            return Ok(Self::from_source(&text, tokens, path.to_path_buf())?
                .with_model_code(is_kimi_tokenizer(&config)));
        }
        let config: JsonValue = serde_json::from_str(&text)
            .map_err(|e| load_error(path, format!("not valid JSON: {e}")))?;
        let Some(config) = config.as_object() else {
            return Err(load_error(path, "not a JSON object"));
        };
        let tokens = special_tokens_from_config(config);
        let kimi = is_kimi_tokenizer(config);
        let template = match config.get("chat_template") {
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
        };
        Ok(template?.with_model_code(kimi))
    }

    /// With Moonshot's tokenizer named in the config, renders as its `tokenization_kimi.py`
    /// does: the K2.5 / K2.6 version where the template reads `tools_ts_str` (only that
    /// version computes it), else the K2 version (tool keys sorted).
    fn with_model_code(mut self, kimi_tokenizer: bool) -> Self {
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.model_code = match (kimi_tokenizer, inner.source.contains(TOOLS_TS_STR)) {
                (false, _) => ModelCode::None,
                (true, false) => ModelCode::KimiSortedTools,
                (true, true) => ModelCode::KimiTypeScriptTools,
            };
        }
        self
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
                model_code: ModelCode::None,
            }),
        })
    }

    /// Renders `messages` (an OpenAI messages array) as transformers does, with
    /// `add_generation_prompt` and `extra` top-level variables (`tools`,
    /// `enable_thinking`, …). Errors name the template file.
    ///
    /// Variables: the special tokens, then `tools = documents = none` (and Kimi K2.5's
    /// defaults, see the module docs), then `extra` (which overrides them), then
    /// `messages` and `add_generation_prompt`. Keys whose value is `null` are dropped from
    /// each message, as transformers ≥ 5 does.
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
        if inner.model_code == ModelCode::KimiTypeScriptTools {
            // The defaults of `apply_chat_template(…, thinking=True, preserve_thinking=False)`.
            ctx.insert("thinking", Value::from(true));
            ctx.insert("preserve_thinking", Value::from(false));
        }
        let mut sorted_tools = None;
        for (key, value) in extra {
            match key.as_str() {
                "tools" if inner.model_code != ModelCode::None => {
                    let sorted = deep_sorted(value);
                    ctx.insert("tools", json_to_value(&sorted));
                    sorted_tools = Some(sorted);
                }
                key => ctx.insert(key, json_to_value(value)),
            }
        }
        match (inner.model_code, &sorted_tools) {
            (ModelCode::KimiTypeScriptTools, Some(tools)) if json_truthy(tools) => {
                // As `tokenization_kimi.py`: on any failure of the encoder the template gets
                // no `tools_ts_str` and declares the tools as JSON; on success the declarations
                // replace a `tools_ts_str` the caller passed.
                match encode_tools_to_typescript_style(tools) {
                    Ok(declarations) => ctx.insert(TOOLS_TS_STR, Value::from(declarations)),
                    Err(e) => tracing::debug!(
                        template = %inner.origin.display(),
                        error = %e,
                        "tools declared as JSON, as tokenization_kimi.py does when its encoder fails"
                    ),
                }
            }
            (ModelCode::None, _) => {
                let has_tools = extra
                    .get("tools")
                    .is_some_and(|t| t.as_array().is_some_and(|a| !a.is_empty()));
                if has_tools
                    && !extra.contains_key(TOOLS_TS_STR)
                    && inner.source.contains(TOOLS_TS_STR)
                {
                    return Err(TemplateError::Render {
                        template: inner.origin.clone(),
                        detail: format!(
                            "this template declares tools from `{TOOLS_TS_STR}`, which only \
                             Moonshot's tokenization_kimi.py computes, and no tokenizer_config.json \
                             beside the template names that tokenizer (`auto_map`): put the \
                             model's tokenizer_config.json next to it, or render rows with tools \
                             on the server"
                        ),
                    });
                }
            }
            _ => {}
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

    /// The variables the template looks up (a static reading of its source, every branch
    /// counted): a `chat_template_kwargs` key outside it changes nothing.
    pub fn reads(&self) -> std::collections::HashSet<String> {
        self.inner
            .env
            .get_template(TEMPLATE_NAME)
            .map(|t| t.undeclared_variables(false))
            .unwrap_or_default()
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

/// Whether the config's tokenizer is Moonshot's `TikTokenTokenizer`, whose
/// `apply_chat_template` adds to transformers' (`auto_map.AutoTokenizer` names
/// `tokenization_kimi.…`).
fn is_kimi_tokenizer(config: &Map<String, JsonValue>) -> bool {
    let names = |v: &JsonValue| match v {
        JsonValue::String(s) => s.starts_with("tokenization_kimi."),
        JsonValue::Array(list) => list.iter().any(|v| {
            v.as_str()
                .is_some_and(|s| s.starts_with("tokenization_kimi."))
        }),
        _ => false,
    };
    config
        .get("auto_map")
        .and_then(|m| m.get("AutoTokenizer"))
        .is_some_and(names)
}

/// `value` with every object's keys in sorted order, at every depth (Python's
/// `sorted(dict.items())` compares keys by code point, as `str::cmp` does).
fn deep_sorted(value: &JsonValue) -> JsonValue {
    match value {
        JsonValue::Object(map) => {
            let mut entries: Vec<(&String, &JsonValue)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            JsonValue::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k.clone(), deep_sorted(v)))
                    .collect(),
            )
        }
        JsonValue::Array(items) => JsonValue::Array(items.iter().map(deep_sorted).collect()),
        other => other.clone(),
    }
}

/// The `tokenizer_config.json` next to a template file, if readable (else empty).
fn sibling_config(template: &Path) -> Map<String, JsonValue> {
    let config_path = template.with_file_name("tokenizer_config.json");
    let Ok(text) = std::fs::read_to_string(&config_path) else {
        return Map::new();
    };
    match serde_json::from_str::<JsonValue>(text.trim_start_matches('\u{feff}')) {
        Ok(JsonValue::Object(config)) => {
            tracing::debug!(config = %config_path.display(), "special tokens for the chat template");
            config
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
    env.set_unknown_method_callback(unknown_method);
    env.set_formatter(|out, _state, value| out.write_str(&py_str(value)).map_err(Error::from));
    env.add_filter("tojson", tojson_filter);
    env.add_test("iterable", is_iterable);
    env.add_test("sequence", is_sequence);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prompt::Tokenizer;
    use serde_json::json;

    fn template(source: &str) -> ChatTemplate {
        ChatTemplate::from_source(source, Map::new(), PathBuf::from("test.jinja")).unwrap()
    }

    fn render_expr(expr: &str, vars: JsonValue) -> String {
        let extra = vars.as_object().cloned().unwrap_or_default();
        template(expr).render(&json!([]), false, &extra).unwrap()
    }

    /// trim_blocks, lstrip_blocks, loop controls, Python string methods, slicing and
    /// `namespace` behave as under transformers.
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

    /// `raise_exception` becomes `Raised` with the template's message and file, a row
    /// error; other render failures are `Render`.
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

    /// A template that does not compile, and a missing template or tokenizer file, are load
    /// errors naming the file.
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

    /// A config's `default` template from a list, its token objects as strings, a list
    /// without `default` refused, and the sibling `chat_template.jinja` fallback.
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

    /// A `.jinja` file renders without special tokens alone, and takes them from a
    /// `tokenizer_config.json` beside it.
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

    /// Null message keys are dropped, and extra variables override the special tokens and
    /// `tools`.
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

    /// With Moonshot's tokenizer named in the config, tool keys are sorted at every depth
    /// before rendering (its `deep_sort_dict`); other configs keep the row's order. A template
    /// that reads `tools_ts_str` refuses rows with tools unless the caller passes it.
    #[test]
    fn kimi_tool_keys_are_sorted_and_tools_ts_str_is_required() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("chat_template.jinja");
        std::fs::write(&path, "{{ tools | tojson }}").unwrap();
        let tools = json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"z": 1, "a": [{"y": 2, "b": 3}]}}}]});
        let render = |t: &ChatTemplate| {
            t.render(&json!([]), false, tools.as_object().unwrap())
                .unwrap()
        };
        let plain = ChatTemplate::from_file(&path).unwrap();
        assert_eq!(
            render(&plain),
            r#"[{"type": "function", "function": {"name": "f", "parameters": {"z": 1, "a": [{"y": 2, "b": 3}]}}}]"#
        );
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]}}"#,
        )
        .unwrap();
        let kimi = ChatTemplate::from_file(&path).unwrap();
        assert_eq!(
            render(&kimi),
            r#"[{"function": {"name": "f", "parameters": {"a": [{"b": 3, "y": 2}], "z": 1}}, "type": "function"}]"#
        );

        let k25 = template(
            "{% if tools %}{{ tools_ts_str if tools_ts_str else tools | tojson }}{% endif %}",
        );
        let err = k25
            .render(&json!([]), false, tools.as_object().unwrap())
            .unwrap_err();
        assert!(
            err.is_row_error() && err.to_string().contains("tools_ts_str"),
            "{err}"
        );
        let mut extra = tools.as_object().unwrap().clone();
        extra.insert("tools_ts_str".into(), json!("type f = () => any;"));
        assert_eq!(
            k25.render(&json!([]), false, &extra).unwrap(),
            "type f = () => any;"
        );
        assert_eq!(k25.render(&json!([]), false, &Map::new()).unwrap(), "");
    }

    /// With Moonshot's tokenizer named beside a template that reads `tools_ts_str` (K2.5),
    /// the template gets the TypeScript declarations of the sorted tools and the override's
    /// `thinking`/`preserve_thinking` defaults; when the encoder fails it gets no
    /// `tools_ts_str` (JSON fallback), and a caller's `tools_ts_str` survives only then.
    #[test]
    fn kimi_k25_declares_tools_as_typescript_with_vendor_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("chat_template.jinja");
        std::fs::write(
            &path,
            "{% if tools_ts_str %}{{ tools_ts_str }}{% else %}{{ tools | tojson }}{% endif %}|{{ thinking }}|{{ preserve_thinking }}",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]}}"#,
        )
        .unwrap();
        let t = ChatTemplate::from_file(&path).unwrap();
        let tool = |prop: JsonValue| {
            json!([{"type": "function", "function": {"parameters":
                {"properties": {"b": prop, "a": {"type": "string"}}, "type": "object"}, "name": "f"}}])
        };
        let render = |extra: JsonValue| {
            t.render(&json!([]), true, extra.as_object().unwrap())
                .unwrap()
        };
        assert_eq!(
            render(json!({"tools": tool(json!({"type": "integer"}))})),
            "# Tools\n\n## functions\nnamespace functions {\ntype f = (_: {\n  a?: string,\n  b?: number\n}) => any;\n}\n|True|False"
        );
        // No tools: no declarations; the row's own `thinking` wins over the default.
        assert_eq!(render(json!({"thinking": false})), "null|False|False");
        // The encoder fails on a property without a type: the sorted tools as JSON, and the
        // caller's `tools_ts_str` is what the template sees.
        let bad = tool(json!({"description": "no type"}));
        assert_eq!(
            render(json!({"tools": bad})),
            r#"[{"function": {"name": "f", "parameters": {"properties": {"a": {"type": "string"}, "b": {"description": "no type"}}, "type": "object"}}, "type": "function"}]|True|False"#
        );
        assert_eq!(
            render(json!({"tools": bad, "tools_ts_str": "mine"})),
            "mine|True|False"
        );
        let good =
            render(json!({"tools": tool(json!({"type": "string"})), "tools_ts_str": "mine"}));
        assert!(good.starts_with("# Tools\n"), "{good}");
    }

    /// `{% generation %}` blocks render as their content, modifiers kept, and the word
    /// elsewhere is left alone.
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

    /// `strftime_now` formats the local date, and an empty format gives an empty string.
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
}
