//! A throwaway certificate authority for TLS tests, made with the `openssl` command.

use std::path::Path;
use std::process::Command;

use crate::TestkitError;

const OPENSSL: &str = "openssl";

fn openssl(dir: &Path, args: &[&str]) -> Result<(), TestkitError> {
    let output = Command::new(OPENSSL)
        .args(args)
        .current_dir(dir)
        .output()
        .map_err(|source| TestkitError::Spawn {
            binary: OPENSSL.into(),
            source,
        })?;
    if !output.status.success() {
        return Err(TestkitError::CommandFailed {
            command: format!("openssl {args:?}"),
            detail: String::from_utf8_lossy(&output.stderr).into_owned(),
        });
    }
    Ok(())
}

/// Writes a throwaway certificate authority (`ca.crt`, `ca.key`) and a server certificate
/// it signed for `127.0.0.1` and `localhost` (`server.crt`, `server.key`) into `dir`, with
/// the `openssl` command (Debian: `apt-get install openssl`). Valid for two days.
///
/// # Errors
/// [`TestkitError::Spawn`] when `openssl` cannot run, [`TestkitError::CommandFailed`] when
/// it fails, [`TestkitError::File`] when a file cannot be written.
pub fn tls_certificates(dir: &Path) -> Result<(), TestkitError> {
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509"];
    ca.extend(ec);
    ca.extend([
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=floodgate test CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    ]);
    openssl(dir, &ca)?;
    let mut csr = vec!["req"];
    csr.extend(ec);
    csr.extend([
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
    ]);
    openssl(dir, &csr)?;
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
         keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n",
    )
    .map_err(|source| TestkitError::File {
        what: "writing the server certificate's extensions",
        path: dir.join("server.ext"),
        source,
    })?;
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.crt",
            "-days",
            "2",
            "-extfile",
            "server.ext",
        ],
    )
}
