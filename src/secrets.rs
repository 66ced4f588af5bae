//! The values spool sends that nobody else may read — a server's API key, the object
//! store's credentials — and the one way text from outside (an error body, a store's
//! answer) is cleaned of them before it is logged, stored, shown or cut.
//!
//! Invariants: text is redacted whole, before any cut, so a cut never leaves part of a
//! secret; a known value is replaced wherever it appears, also percent- or JSON-escaped;
//! credential-shaped fields (`Authorization`, `X-Amz-Security-Token`, `X-Amz-Credential`,
//! `X-Amz-Signature`, `Credential=`, `Signature=`, S3's `<AWSAccessKeyId>` and
//! `<SignatureProvided>`) lose their values whoever's they are (an `Authorization` value
//! keeps its scheme word), as a store's credentials may come from its own provider chain
//! and never pass through here.

/// What a secret is replaced with.
pub const MASK: &str = "***";

/// Field names whose value is a credential, and the characters that may separate a name
/// from its value (`name: value` in a header echo, `name=value` in a query or an
/// `Authorization` parameter, `<Name>value` in XML).
const FIELDS: &[(&str, &[u8])] = &[
    ("authorization", b":=>"),
    ("x-amz-security-token", b":=>"),
    ("x-amz-credential", b":=>"),
    ("x-amz-signature", b":=>"),
    ("x-api-key", b":=>"),
    ("awsaccesskeyid", b":=>"),
    ("signatureprovided", b":=>"),
    ("credential", b"="),
    ("signature", b"="),
];

/// Known secret values; cheap to clone, and its `Debug` shows only how many it holds.
#[derive(Clone, Default)]
pub struct Secrets {
    /// Every form a value may take in text, longest first.
    forms: Vec<String>,
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secrets({} forms)", self.forms.len())
    }
}

impl Secrets {
    /// The non-empty `values`, each also in its percent-encoded and JSON-escaped forms.
    pub fn new<S: AsRef<str>>(values: impl IntoIterator<Item = S>) -> Secrets {
        let mut forms = Vec::new();
        for v in values {
            let v = v.as_ref();
            if v.is_empty() {
                continue;
            }
            forms.push(v.to_string());
            forms.push(percent_encoded(v));
            if let Ok(json) = serde_json::to_string(v) {
                forms.push(json[1..json.len() - 1].to_string());
            }
            forms.push(v.replace('/', "\\/"));
        }
        forms.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        forms.dedup();
        Secrets { forms }
    }

    /// `text` with every known value and every credential-shaped field's value replaced
    /// by [`MASK`].
    pub fn redact(&self, text: &str) -> String {
        let mut s = text.to_string();
        for f in &self.forms {
            if s.contains(f.as_str()) {
                s = s.replace(f.as_str(), MASK);
            }
        }
        redact_fields(&s)
    }
}

/// RFC 3986 percent-encoding of everything but the unreserved characters.
fn percent_encoded(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for b in v.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `text` with the value of every credential-shaped field replaced by [`MASK`] (see the
/// module's invariants), known or not.
pub fn redact_fields(text: &str) -> String {
    let lower = text.to_ascii_lowercase();
    let b = lower.as_bytes();
    let mut spans: Vec<(usize, usize)> = Vec::new();
    for (name, seps) in FIELDS {
        let mut from = 0;
        while let Some(at) = lower[from..].find(name) {
            let start = from + at;
            from = start + name.len();
            if start > 0 && b[start - 1].is_ascii_alphanumeric() {
                continue;
            }
            let mut i = from;
            while i < b.len() && matches!(b[i], b'"' | b'\'' | b'\\') {
                i += 1;
            }
            let Some(&sep) = b.get(i).filter(|c| seps.contains(c)) else {
                continue;
            };
            i += 1;
            while i < b.len() && matches!(b[i], b' ' | b'\t' | b'"' | b'\'' | b'\\') {
                i += 1;
            }
            // An `Authorization` value keeps its scheme (`Bearer`, `AWS4-HMAC-SHA256`).
            if *name == "authorization" {
                let word = b[i..]
                    .iter()
                    .take_while(|c| c.is_ascii_alphanumeric() || **c == b'-')
                    .count();
                if word > 0 && b.get(i + word) == Some(&b' ') {
                    i += word + 1;
                }
            }
            let end = b[i..]
                .iter()
                .position(|&c| match c {
                    b'\r' | b'\n' | b'"' | b'\'' | b'<' | b'&' | b'\\' => true,
                    // A `name=value` parameter ends at the next parameter.
                    b',' | b' ' | b';' => sep == b'=',
                    _ => false,
                })
                .map_or(b.len(), |n| i + n);
            if end > i && !text[i..end].starts_with(MASK) {
                spans.push((i, end));
            }
        }
    }
    if spans.is_empty() {
        return text.to_string();
    }
    spans.sort();
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    for (s, e) in spans {
        if e <= at {
            continue;
        }
        let s = s.max(at);
        out.push_str(&text[at..s]);
        out.push_str(MASK);
        at = e;
    }
    out.push_str(&text[at..]);
    out
}

/// The first `max` characters of `text` (redact first: see the module's invariants).
pub fn cut(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((at, _)) => text[..at].to_string(),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A known value goes wherever it is, as is or escaped; nothing else is touched.
    #[test]
    fn known_values_go_in_every_form() {
        let s = Secrets::new(["sk-a/b+c=d"]);
        let shown =
            s.redact("plain sk-a/b+c=d, query sk-a%2Fb%2Bc%3Dd, json \"sk-a\\/b+c=d\", the end");
        assert_eq!(shown, "plain ***, query ***, json \"***\", the end");
        assert_eq!(Secrets::new([""]).redact("text"), "text");
        assert!(!format!("{s:?}").contains("sk-"));
    }

    /// The shapes credentials take in real error bodies lose their values: S3's
    /// `SignatureDoesNotMatch` (key id, signature, the canonical request's headers), a
    /// header echo as text and as JSON, a presigned URL; prose mentioning a signature or
    /// a credential keeps its words.
    #[test]
    fn credential_shaped_fields_lose_their_values() {
        let s3 = "<Error><Code>SignatureDoesNotMatch</Code><Message>The request signature we calculated does not match the signature you provided.</Message><AWSAccessKeyId>AKIAEXAMPLEKEY123456</AWSAccessKeyId><SignatureProvided>0f1e2d3c4b5a69788796a5b4c3d2e1f0</SignatureProvided><CanonicalRequest>GET\n/b/k\n\nhost:s3.local\nx-amz-security-token:FwoGZXIvYXdzEJr//////////wEaDKeyToken+/=\nx-amz-date:20261204T000000Z\n</CanonicalRequest></Error>";
        let shown = redact_fields(s3);
        for gone in [
            "AKIAEXAMPLEKEY123456",
            "0f1e2d3c4b5a",
            "FwoGZXIvYXdz",
            "KeyToken",
        ] {
            assert!(!shown.contains(gone), "{gone} in {shown}");
        }
        assert!(shown.contains("does not match the signature you provided"));
        assert!(shown.contains("x-amz-date:20261204T000000Z"), "{shown}");

        let echo = "authorization: AWS4-HMAC-SHA256 Credential=AKIAEXAMPLEKEY123456/20261204/us-east-1/s3/aws4_request, SignedHeaders=host;x-amz-date, Signature=deadbeefcafe0123\nuser-agent: spool";
        let shown = redact_fields(echo);
        assert_eq!(
            shown,
            "authorization: AWS4-HMAC-SHA256 ***\nuser-agent: spool"
        );

        let json = r#"{"headers": {"Authorization": "Bearer sk-live-0123456789", "X-Api-Key": "k-9876543210"}}"#;
        let shown = redact_fields(json);
        assert_eq!(
            shown,
            r#"{"headers": {"Authorization": "Bearer ***", "X-Api-Key": "***"}}"#
        );

        let url = "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAEXAMPLE%2F20261204%2Fus-east-1&X-Amz-Security-Token=FwoGZXIv%2Fabc&X-Amz-Signature=abc123&x-id=GetObject";
        let shown = redact_fields(url);
        assert_eq!(
            shown,
            "https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***&X-Amz-Security-Token=***&X-Amz-Signature=***&x-id=GetObject"
        );
        let prose = "invalid credential: check the signature of the request";
        assert_eq!(redact_fields(prose), prose);
    }

    /// Redacting before the cut leaves nothing of a key that straddles it; the cut counts
    /// characters, not bytes.
    #[test]
    fn redaction_before_the_cut_leaves_no_piece() {
        let key = "sk-live-0123456789abcdef";
        let text = format!("{}{key} and more", "x".repeat(490));
        let shown = cut(&Secrets::new([key]).redact(&text), 500);
        assert!(!shown.contains("sk-live-01"), "{shown}");
        assert_eq!(cut("ééé", 2), "éé");
        assert_eq!(cut("ab", 5), "ab");
    }
}
