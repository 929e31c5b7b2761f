//! Throwaway TLS material: a test CA and a server certificate for `localhost` / `127.0.0.1`,
//! plus rustls configs (ring provider) built from them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// A CA and one server certificate it signed.
pub struct TestPki {
    /// The CA certificate, PEM.
    pub ca_pem: String,
    /// The CA certificate, DER.
    pub ca_der: CertificateDer<'static>,
    /// The server certificate (SANs `localhost`, `127.0.0.1`), PEM.
    pub cert_pem: String,
    /// The server certificate, DER.
    pub cert_der: CertificateDer<'static>,
    /// The server key (PKCS#8), PEM.
    pub key_pem: String,
    /// The server key (PKCS#8), DER.
    pub key_der: Vec<u8>,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl TestPki {
    /// Generates a fresh CA and server certificate.
    pub fn new() -> TestPki {
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "compactor test CA");
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = ca_params.self_signed(&ca_key).expect("CA cert");

        let key = KeyPair::generate().expect("server key");
        let mut params =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
                .expect("server params");
        params
            .distinguished_name
            .push(DnType::CommonName, "localhost");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        let cert = params.signed_by(&key, &ca, &ca_key).expect("server cert");

        TestPki {
            ca_pem: ca.pem(),
            ca_der: ca.der().clone(),
            cert_pem: cert.pem(),
            cert_der: cert.der().clone(),
            key_pem: key.serialize_pem(),
            key_der: key.serialize_der(),
        }
    }

    /// A rustls server config presenting the server certificate, ALPN `h2` then `http/1.1`.
    pub fn server_config(&self) -> rustls::ServerConfig {
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_no_client_auth()
            .with_single_cert(
                vec![self.cert_der.clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone())),
            )
            .expect("server cert config");
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        config
    }

    /// A rustls client config trusting only the test CA.
    pub fn client_config(&self) -> rustls::ClientConfig {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.ca_der.clone()).expect("add test CA");
        rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_root_certificates(roots)
            .with_no_client_auth()
    }

    /// Writes `ca.pem`, `cert.pem` and `key.pem` into `dir`; returns their paths in that order.
    pub fn write_to(&self, dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
        let ca = dir.join("ca.pem");
        let cert = dir.join("cert.pem");
        let key = dir.join("key.pem");
        std::fs::write(&ca, &self.ca_pem).expect("write ca.pem");
        std::fs::write(&cert, &self.cert_pem).expect("write cert.pem");
        std::fs::write(&key, &self.key_pem).expect("write key.pem");
        (ca, cert, key)
    }
}

impl Default for TestPki {
    fn default() -> Self {
        TestPki::new()
    }
}
