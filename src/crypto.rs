//! The process's TLS crypto provider, installed once before any client is built: below
//! every layer that opens a connection (`upstream` to servers, `output::bucket` to object
//! stores), so neither reaches into the other for it.

/// Makes `ring` the process's rustls provider, once; every reqwest client needs one and
/// builds its TLS settings even for `http://` use. Call before building any reqwest client.
pub fn install_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Err only when a provider is already installed, which is as good.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}
