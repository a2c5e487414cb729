//! The CLI's error: what went wrong, said once on stderr, and the exit status it maps to.

use std::io;
use std::process::ExitCode;

use floodgate_core::{MemoryError, PolicyError};

/// Exit status for a bad command line (the same as clap's own usage errors).
const EXIT_USAGE: u8 = 2;
/// Exit status for bad input, I/O failures and everything else.
const EXIT_FAILURE: u8 = 1;

/// Everything a subcommand can fail with.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CliError {
    /// Missing, conflicting or inapplicable flags.
    #[error("{0}")]
    Usage(String),
    /// A policy that core refused; its message names the bad field.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    /// A bad line of input.
    #[error("line {line}: {message}")]
    Input {
        /// 1-based line number.
        line: u64,
        /// What is wrong with it.
        message: String,
    },
    /// Reading or writing failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The in-memory store refused a check.
    #[error(transparent)]
    Store(#[from] MemoryError),
    /// Drawing the chart failed.
    #[error("cannot draw the chart: {0}")]
    Plot(String),
    /// Talking to Redis failed; `context` says what was being done, on which server (its URL
    /// with the password redacted) and for which key.
    #[error("{context}: {source}")]
    Redis {
        /// What was being done.
        context: String,
        /// The cause (floodgate-redis' errors never show a password).
        #[source]
        source: floodgate_redis::Error,
    },
    /// Connecting to Redis failed (the message names the server, password redacted).
    #[error(transparent)]
    Connect(floodgate_redis::Error),
    /// Something else went wrong at run time (a benchmark that made no decision at all).
    #[error("{0}")]
    Failed(String),
}

/// Writes `text` to stdout: a closed stdout (`floodgate reset ... | true`) is an I/O error,
/// which [`CliError::report`] takes quietly, not a panic of `print!`.
pub(crate) fn print(text: &str) -> Result<(), CliError> {
    use io::Write as _;
    let mut out = io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| CliError::io("cannot write to stdout", e))
}

/// Writes `value` to stdout as one line of JSON (see [`print`]).
pub(crate) fn print_json(value: &impl serde::Serialize) -> Result<(), CliError> {
    let mut text = serde_json::to_string(value).map_err(|e| CliError::Failed(e.to_string()))?;
    text.push('\n');
    print(&text)
}

impl CliError {
    /// A usage error.
    pub(crate) fn usage(message: impl Into<String>) -> Self {
        CliError::Usage(message.into())
    }

    /// An I/O error while doing `context`.
    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Self {
        CliError::Io {
            context: context.into(),
            source,
        }
    }

    /// A Redis error while doing `context`.
    pub(crate) fn redis(context: impl Into<String>, source: floodgate_redis::Error) -> Self {
        CliError::Redis {
            context: context.into(),
            source,
        }
    }

    /// Prints the error on stderr and returns the exit status.
    ///
    /// A closed stdout (`floodgate simulate ... | head`) is not an error worth reporting.
    pub(crate) fn report(&self) -> ExitCode {
        if let CliError::Io { source, .. } = self
            && source.kind() == io::ErrorKind::BrokenPipe
        {
            return ExitCode::SUCCESS;
        }
        eprintln!("error: {self}");
        let code = match self {
            CliError::Usage(_) | CliError::Policy(_) => {
                eprintln!("\nFor more information, try '--help'.");
                EXIT_USAGE
            }
            _ => EXIT_FAILURE,
        };
        ExitCode::from(code)
    }
}
