//! TLS for `https://` servers: rustls with the `ring` provider, through reqwest.
//!
//! Trust: the system's roots (rustls-platform-verifier: the OS store, read offline) unless
//! `server.ca_cert` names a PEM file, whose certificates are then the only roots (as
//! curl's `--cacert`: a private CA does not silently widen to every public one).
//!
//! Invariants: the process-wide crypto provider is `ring` (never aws-lc), installed before
//! any reqwest client is built (reqwest panics without one); a certificate the client
//! refuses at start-up stops the run with an error naming the URL and the certificate's
//! fault (exit 2) instead of being waited on like a server that is down.

use crate::config::{Config, ConfigError};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use std::path::Path;
use std::time::Duration;

/// How long the start-up handshake with each `https://` server may take.
const CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// Which certificates a server's chain must lead to.
#[derive(Clone, Debug, Default)]
pub enum TrustRoots {
    /// The operating system's roots.
    #[default]
    System,
    /// Only these CAs (`server.ca_cert`).
    Only(Vec<CertificateDer<'static>>),
}

pub use crate::crypto::install_provider;

/// The CAs `https://` servers are checked against: `server.ca_cert`'s, or the system's.
/// A file without a usable certificate is the config's error, naming the key and the path.
pub fn trust_roots(cfg: &Config) -> Result<TrustRoots, ConfigError> {
    match &cfg.server.ca_cert {
        None => Ok(TrustRoots::System),
        Some(p) => load_ca(p)
            .map(TrustRoots::Only)
            .map_err(|why| cfg.invalid("server.ca_cert", why)),
    }
}

/// The CA certificates of a PEM file: at least one, each usable as a trust anchor. The
/// error says what is wrong with the file (the caller names the key and the path).
pub fn load_ca(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut certs = Vec::new();
    for c in CertificateDer::pem_slice_iter(&bytes) {
        certs.push(c.map_err(|e| format!("{} is not valid PEM: {e}", path.display()))?);
    }
    if certs.is_empty() {
        return Err(format!(
            "{} holds no PEM certificate (`-----BEGIN CERTIFICATE-----`)",
            path.display()
        ));
    }
    let mut store = rustls::RootCertStore::empty();
    for (i, c) in certs.iter().enumerate() {
        store.add(c.clone()).map_err(|e| {
            format!(
                "certificate {} of {} is not a usable CA: {e}",
                i + 1,
                path.display()
            )
        })?;
    }
    Ok(certs)
}

/// `builder` with the ring provider's TLS and `roots`.
pub(crate) fn configure(
    builder: reqwest::ClientBuilder,
    roots: &TrustRoots,
) -> reqwest::ClientBuilder {
    install_provider();
    let builder = builder.tls_backend_rustls();
    match roots {
        TrustRoots::System => builder,
        TrustRoots::Only(certs) => builder.tls_certs_only(
            certs
                .iter()
                .filter_map(|c| reqwest::Certificate::from_der(c).ok()),
        ),
    }
}

/// The TLS fault in a reqwest error (a refused certificate, a failed handshake), if the
/// error is one; `None` for everything else (refused connection, timeout, HTTP errors).
pub fn tls_fault(err: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if let Some(t) = e.downcast_ref::<rustls::Error>() {
            return Some(t.to_string());
        }
        // io::Error's `source` skips the error it wraps (the connector nests io::Errors
        // around rustls's): look inside.
        cur = match e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            Some(inner) => Some(inner as &(dyn std::error::Error + 'static)),
            None => e.source(),
        };
    }
    None
}

/// A TLS handshake with `base` failed in a way no retry mends.
#[derive(Debug, thiserror::Error)]
#[error("TLS with {url} failed: {fault}{hint}")]
pub struct TlsRefused {
    pub url: String,
    pub fault: String,
    hint: &'static str,
}

impl super::Upstream {
    /// One request to each `https://` server in `urls`, to see its certificate accepted
    /// before any work is queued. A server that does not answer is not an error here (the
    /// workers wait for it); a certificate refused is, since waiting would not change it.
    pub async fn check_tls(&self, urls: &[String], custom_ca: bool) -> Result<(), TlsRefused> {
        for url in urls.iter().filter(|u| is_https(u)) {
            let result = self
                .client
                .get(url.as_str())
                .timeout(CHECK_TIMEOUT)
                .send()
                .await;
            if let Err(e) = result {
                if let Some(fault) = tls_fault(&e) {
                    return Err(TlsRefused {
                        url: url.clone(),
                        hint: hint(&fault, custom_ca),
                        fault,
                    });
                }
            }
        }
        Ok(())
    }
}

/// What the user can do about a refused handshake.
fn hint(fault: &str, custom_ca: bool) -> &'static str {
    if fault.contains("UnknownIssuer") {
        if custom_ca {
            " (the certificate is not signed by the CA in server.ca_cert)"
        } else {
            " (the certificate is not signed by a CA this system trusts: give its CA as server.ca_cert)"
        }
    } else if fault.contains("not valid for name") {
        " (the certificate does not name the host in the URL: use a host name it lists)"
    } else if fault.contains("corrupt message") {
        " (the server does not answer in TLS: is it a plain http:// server?)"
    } else if fault.contains("CaUsedAsEndEntity") {
        " (the server presents a CA certificate as its own: it needs one signed by that CA)"
    } else if fault.contains("Expired") || fault.contains("NotValidYet") {
        " (outside the certificate's validity period: check the server's certificate and both clocks)"
    } else {
        ""
    }
}

/// Whether `url` is served over TLS (config validation keeps schemes lower case).
pub fn is_https(url: &str) -> bool {
    url.get(..8)
        .is_some_and(|s| s.eq_ignore_ascii_case("https://"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file that is not PEM, and a PEM file holding only a key, are refused with the
    /// path; a real CA certificate loads.
    #[test]
    fn ca_files_must_hold_a_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, b"hello, not a certificate\n").unwrap();
        let e = load_ca(&junk).unwrap_err();
        assert!(
            e.contains("junk.pem") && e.contains("no PEM certificate"),
            "{e}"
        );

        let key = rcgen::KeyPair::generate().unwrap();
        let key_only = dir.path().join("key.pem");
        std::fs::write(&key_only, key.serialize_pem()).unwrap();
        let e = load_ca(&key_only).unwrap_err();
        assert!(e.contains("key.pem"), "{e}");

        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = params.self_signed(&key).unwrap();
        let good = dir.path().join("ca.pem");
        std::fs::write(&good, ca.pem()).unwrap();
        assert_eq!(load_ca(&good).unwrap().len(), 1);

        let e = load_ca(&dir.path().join("missing.pem")).unwrap_err();
        assert!(
            e.contains("missing.pem") && e.contains("cannot read"),
            "{e}"
        );
    }

    /// The fault is found behind the io::Errors that the connector nests it in.
    #[test]
    fn tls_fault_looks_inside_io_errors() {
        let inner = rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer);
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, inner);
        let io = std::io::Error::other(io);
        let f = tls_fault(&io).unwrap();
        assert!(f.contains("UnknownIssuer"), "{f}");
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(tls_fault(&refused), None);
    }
}
