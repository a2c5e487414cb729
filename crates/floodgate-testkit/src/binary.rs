//! Finding the `redis-server` and `redis-cli` binaries.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

use crate::TestkitError;

/// Environment variable naming the `redis-server` binary to use.
pub const REDIS_SERVER_ENV: &str = "FLOODGATE_REDIS_SERVER";
/// Environment variable naming the `redis-cli` binary to use.
pub const REDIS_CLI_ENV: &str = "FLOODGATE_REDIS_CLI";

/// Which binary to find.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Binary {
    Server,
    Cli,
}

impl Binary {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Server => "redis-server",
            Self::Cli => "redis-cli",
        }
    }

    pub(crate) fn env_var(self) -> &'static str {
        match self {
            Self::Server => REDIS_SERVER_ENV,
            Self::Cli => REDIS_CLI_ENV,
        }
    }
}

/// Finds the `redis-server` binary: `$FLOODGATE_REDIS_SERVER` if set, else
/// `redis-server` on `PATH`. The environment is read at call time.
///
/// # Errors
/// [`TestkitError::BinaryNotFound`], whose message says to run `scripts/install-redis`.
pub fn redis_server_binary() -> Result<PathBuf, TestkitError> {
    find(Binary::Server, None)
}

/// Finds the `redis-cli` binary: `$FLOODGATE_REDIS_CLI` if set, else
/// `redis-cli` on `PATH`. The environment is read at call time.
///
/// # Errors
/// [`TestkitError::BinaryNotFound`], whose message says to run `scripts/install-redis`.
pub fn redis_cli_binary() -> Result<PathBuf, TestkitError> {
    find(Binary::Cli, None)
}

/// Finds `which`, preferring `explicit`, then its env var, then `PATH`.
pub(crate) fn find(which: Binary, explicit: Option<&Path>) -> Result<PathBuf, TestkitError> {
    resolve(
        which,
        explicit,
        std::env::var_os(which.env_var()).as_deref(),
        std::env::var_os("PATH").as_deref(),
    )
}

/// The pure part of [`find`], so it can be tested without touching the
/// process environment.
fn resolve(
    which: Binary,
    explicit: Option<&Path>,
    env_value: Option<&OsStr>,
    path_var: Option<&OsStr>,
) -> Result<PathBuf, TestkitError> {
    let not_found = |detail: String| TestkitError::BinaryNotFound {
        binary: which.name(),
        env_var: which.env_var(),
        detail,
    };

    let (given, origin): (Option<PathBuf>, String) = match (explicit, env_value) {
        (Some(p), _) => (
            Some(p.to_path_buf()),
            "the builder's binary option".to_owned(),
        ),
        (None, Some(v)) if !v.is_empty() => (
            Some(PathBuf::from(v)),
            format!("{}={}", which.env_var(), Path::new(v).display()),
        ),
        _ => (None, String::new()),
    };

    if let Some(given) = given {
        // A bare name ("redis-server") is looked up on PATH; anything with a
        // separator is taken as a path.
        if given.components().count() == 1 && !given.is_absolute() {
            return search_path(given.as_os_str(), path_var).ok_or_else(|| {
                not_found(format!(
                    "{origin} names `{}`, which is not on PATH",
                    given.display()
                ))
            });
        }
        return if is_executable_file(&given) {
            Ok(given)
        } else if given.exists() {
            Err(not_found(format!(
                "{origin} points at `{}`, which is not an executable file",
                given.display()
            )))
        } else {
            Err(not_found(format!(
                "{origin} points at `{}`, which does not exist",
                given.display()
            )))
        };
    }

    search_path(OsStr::new(which.name()), path_var).ok_or_else(|| {
        let path_text = path_var
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_else(|| "<unset>".to_owned());
        not_found(format!(
            "`{}` is not on PATH ({path_text}) and {} is not set",
            which.name(),
            which.env_var()
        ))
    })
}

fn search_path(name: &OsStr, path_var: Option<&OsStr>) -> Option<PathBuf> {
    let path_var: OsString = path_var?.to_owned();
    std::env::split_paths(&path_var)
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable_file(candidate))
}

fn is_executable_file(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(r: Result<PathBuf, TestkitError>) -> String {
        match r {
            Ok(p) => panic!("expected an error, found {}", p.display()),
            Err(e) => {
                assert!(e.is_binary_not_found(), "{e:?}");
                e.to_string()
            }
        }
    }

    #[test]
    fn env_var_pointing_nowhere_is_reported_with_install_hint() {
        let msg = message(resolve(
            Binary::Server,
            None,
            Some(OsStr::new("/nonexistent/redis-server")),
            Some(OsStr::new("/usr/bin:/bin")),
        ));
        assert!(msg.contains("scripts/install-redis"), "{msg}");
        assert!(
            msg.contains("FLOODGATE_REDIS_SERVER=/nonexistent/redis-server"),
            "{msg}"
        );
        assert!(msg.contains("does not exist"), "{msg}");
    }

    #[test]
    fn missing_from_path_is_reported_with_install_hint() {
        let empty = tempfile::tempdir().expect("tempdir");
        let msg = message(resolve(
            Binary::Cli,
            None,
            None,
            Some(empty.path().as_os_str()),
        ));
        assert!(msg.starts_with("redis-cli not found"), "{msg}");
        assert!(msg.contains("scripts/install-redis"), "{msg}");
        assert!(msg.contains("FLOODGATE_REDIS_CLI"), "{msg}");
    }

    #[test]
    fn explicit_wins_over_env_and_non_executables_are_rejected() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("redis-server");
        std::fs::write(&file, "not a program").expect("write");
        let msg = message(resolve(
            Binary::Server,
            Some(&file),
            Some(OsStr::new("/usr/bin/redis-server")),
            None,
        ));
        assert!(msg.contains("not an executable file"), "{msg}");
    }

    #[test]
    fn found_on_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("redis-server");
        std::fs::write(&file, "#!/bin/sh\n").expect("write");
        let mut perms = std::fs::metadata(&file).expect("meta").permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
        std::fs::set_permissions(&file, perms).expect("chmod");
        let found = resolve(Binary::Server, None, None, Some(dir.path().as_os_str()))
            .expect("found on PATH");
        assert_eq!(found, file);
        // Env var naming a bare program is searched on PATH too.
        let found = resolve(
            Binary::Server,
            None,
            Some(OsStr::new("redis-server")),
            Some(dir.path().as_os_str()),
        )
        .expect("found on PATH");
        assert_eq!(found, file);
    }
}
