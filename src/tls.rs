//! TLS settings built from the config's PEM files: the server side (TLS
//! termination, ALPN h2 and http/1.1) and the client side (https upstreams,
//! system roots plus an optional extra CA).

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::config::TlsFiles;

/// Why TLS could not be set up; the message names the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {what}")]
    File { path: String, what: String },
    #[error("TLS setup: {0}")]
    Rustls(#[from] rustls::Error),
}

fn file_error(path: &Path, what: impl ToString) -> TlsError {
    TlsError::File {
        path: path.display().to_string(),
        what: what.to_string(),
    }
}

/// rustls needs one process-wide crypto provider.
pub fn install_crypto() {
    // Err means one is installed already: fine.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_error(path, format!("cannot read certificates: {e}")))?
        .collect::<Result<_, _>>()
        .map_err(|e| file_error(path, format!("bad PEM: {e}")))?;
    if certs.is_empty() {
        return Err(file_error(path, "no certificate in this file"));
    }
    Ok(certs)
}

/// Checks that `path` holds at least one PEM certificate.
pub fn check_ca(path: &Path) -> Result<(), TlsError> {
    certificates(path).map(|_| ())
}

/// The server side: certificate chain and key, ALPN h2 then http/1.1.
pub fn server_config(files: &TlsFiles) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    install_crypto();
    let chain = certificates(&files.cert)?;
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| file_error(&files.key, format!("cannot read a private key: {e}")))?;
    let mut config = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| {
            file_error(
                &files.cert,
                format!("certificate and key do not match: {e}"),
            )
        })?;
    // http/1.0 too, as nginx: a client that offers only it (curl --http1.0)
    // is served, not refused with a `no_application_protocol` alert.
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec(), b"http/1.0".to_vec()];
    Ok(Arc::new(config))
}

/// The client side for upstreams: the system roots, plus `extra_ca` if given.
pub fn client_config(extra_ca: Option<&Path>) -> Result<rustls::ClientConfig, TlsError> {
    install_crypto();
    let mut roots = rustls::RootCertStore::empty();
    // Unreadable system certificates are skipped, as other TLS clients do.
    for cert in rustls_native_certs::load_native_certs().certs {
        let _ = roots.add(cert);
    }
    if let Some(path) = extra_ca {
        for cert in certificates(path)? {
            roots
                .add(cert)
                .map_err(|e| file_error(path, format!("not a usable CA certificate: {e}")))?;
        }
    }
    Ok(rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth())
}
