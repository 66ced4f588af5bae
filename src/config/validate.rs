//! The checks a loaded config passes before anything uses it: server URLs as RFC 3986
//! writes them, counts and sizes in range, dataset names safe and unique, the generation
//! keys each dataset resolves to. What needs the prompt stage (parser names, a dataset's
//! draw) is `prompt::settings`'s, and `server.ca_cert`'s certificates are loaded by
//! `upstream::tls`: a run checks both before it writes anything.
//!
//! Invariant: the first failure is returned as [`ConfigError::Invalid`], naming the file
//! and the key (exit code 2); nothing is percent-encoded or corrected on the user's behalf.

use super::{valid_name, Api, Concurrency, Config, ConfigError, PromptFormat, MAX_SAMPLES};

impl Config {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        if self.server.urls.is_empty() {
            return Err(self.invalid("server.urls", "at least one URL is needed"));
        }
        for (i, u) in self.server.urls.iter().enumerate() {
            if let Err(why) = check_url(u) {
                // Debug form: a space, tab or line break in the URL is visible.
                return Err(self.invalid(&format!("server.urls[{i}]"), format!("{u:?}: {why}")));
            }
        }
        if self.server.max_attempts == 0 {
            return Err(self.invalid("server.max_attempts", "must be at least 1"));
        }
        if self.server.request_timeout_s.is_nan() || self.server.request_timeout_s <= 0.0 {
            return Err(self.invalid("server.request_timeout_s", "must be > 0"));
        }
        if self.server.context_length == Some(0) {
            return Err(self.invalid("server.context_length", "must be > 0"));
        }
        if self.run.concurrency == Concurrency::Fixed(0) {
            return Err(self.invalid("run.concurrency", "must be at least 1"));
        }
        if self.run.max_concurrency == 0 {
            return Err(self.invalid("run.max_concurrency", "must be at least 1"));
        }
        if self.shards.max_rows == 0 {
            return Err(self.invalid("shards.max_rows", "must be at least 1"));
        }
        if !(1..=22).contains(&self.shards.compression_level) {
            return Err(self.invalid("shards.compression_level", "zstd levels are 1..=22"));
        }
        if self.datasets.is_empty() {
            return Err(self.invalid("dataset", "no [[dataset]] given"));
        }
        let mut seen = std::collections::HashSet::new();
        for (i, d) in self.datasets.iter().enumerate() {
            let key = format!("dataset[{i}].name");
            if !valid_name(&d.name) {
                return Err(self.invalid(
                    &key,
                    format!(
                        "`{}` is not a safe folder name (use [A-Za-z0-9_.-]+, not `.` or `..`)",
                        d.name
                    ),
                ));
            }
            if !seen.insert(d.name.clone()) {
                return Err(self.invalid(&key, format!("`{}` appears twice", d.name)));
            }
            let s = self.sampling.with(&d.sampling);
            if s.max_tokens == 0 {
                return Err(
                    self.invalid(&format!("dataset[{i}].sampling.max_tokens"), "must be > 0")
                );
            }
            if let Some(n) = d.samples.filter(|n| !(1..=MAX_SAMPLES).contains(n)) {
                return Err(self.invalid(
                    &format!("dataset[{i}].samples"),
                    format!("dataset `{}`: must be 1..={MAX_SAMPLES}, not {n}", d.name),
                ));
            }
            let prompt_format = d.prompt_format.or(self.prompt_format);
            if prompt_format == Some(PromptFormat::Raw) && self.server.api == Api::Chat {
                let key = match d.prompt_format {
                    Some(_) => format!("dataset[{i}].prompt_format"),
                    None => "prompt_format".into(),
                };
                return Err(self.invalid(
                    &key,
                    format!(
                        "dataset `{}`: \"raw\" needs a text API (api = \"sglang\" or \"completions\"): the chat API renders every prompt as a turn",
                        d.name
                    ),
                ));
            }
        }
        if let Some(n) = self.samples.filter(|n| !(1..=MAX_SAMPLES).contains(n)) {
            return Err(self.invalid("samples", format!("must be 1..={MAX_SAMPLES}, not {n}")));
        }
        if self.sampling.max_tokens == 0 {
            return Err(self.invalid("sampling.max_tokens", "must be > 0"));
        }
        Ok(())
    }
}

/// Why `url` cannot be a server's base URL (paths such as `/generate` are appended to it).
fn check_url(url: &str) -> Result<(), String> {
    let bytes = url.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        if !url_byte(b) {
            return Err(format!(
                "{} at byte {i} is not allowed in a URL (percent-encode it, e.g. a space as %20)",
                byte_kind(b)
            ));
        }
        if b == b'%'
            && !(bytes.get(i + 1).is_some_and(u8::is_ascii_hexdigit)
                && bytes.get(i + 2).is_some_and(u8::is_ascii_hexdigit))
        {
            return Err(format!(
                "`%` at byte {i} does not start a percent-encoding (`%` and two hex digits)"
            ));
        }
    }
    let scheme = url.split_once("://").map(|(s, _)| s);
    if !matches!(scheme, Some("http" | "https")) {
        return Err(match scheme {
            Some(s) if s.eq_ignore_ascii_case("http") || s.eq_ignore_ascii_case("https") => {
                "write the scheme in lower case (`http://` or `https://`)".into()
            }
            Some(s) => format!("scheme `{s}` is not supported (use http:// or https://)"),
            None => "not an http:// or https:// URL".into(),
        });
    }
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("not a URL: {e}"))?;
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err("no host".into());
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(
            "user info (`user:password@`) is not supported: it would be logged; use server.api_key_env"
                .into(),
        );
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Err(
            "a `?query` or `#fragment` is not supported: API paths are appended to the URL".into(),
        );
    }
    Ok(())
}

/// The bytes RFC 3986 allows in a URI: unreserved, reserved (gen- and sub-delims) and `%`.
fn url_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"-._~:/?#[]@!$&'()*+,;=%".contains(&b)
}

/// A byte named for an error message (the text around it may be a secret).
pub(super) fn byte_kind(b: u8) -> String {
    match b {
        b' ' => "a space".into(),
        b'\t' => "a tab".into(),
        b'\n' | b'\r' => "a line break".into(),
        0..=0x1f | 0x7f => format!("control character 0x{b:02x}"),
        0x80.. => "a non-ASCII character".into(),
        _ => format!("`{}`", b as char),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The URLs servers are really given pass: a port, a path prefix, a trailing slash,
    /// IPv6, a percent-encoded byte, https; the rest of the rules are shown through the
    /// binary (`tls::urls_that_cannot_work_exit_2_naming_the_key`).
    #[test]
    fn usual_server_urls_pass() {
        for u in [
            "http://127.0.0.1:30000",
            "http://gpu-7.internal:8000/",
            "https://api.example.com/v1-proxy/llm",
            "http://[::1]:8000",
            "http://h:1/a%20b",
            "https://h",
        ] {
            assert_eq!(check_url(u), Ok(()), "{u}");
        }
        assert!(check_url("http://h/a b")
            .unwrap_err()
            .contains("a space at byte 10"));
    }
}
