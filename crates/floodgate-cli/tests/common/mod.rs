//! Runs the built `floodgate` binary.

// Each test binary uses its own part of this module.
#![allow(dead_code)]

use std::io::Write;
use std::process::{Command, ExitStatus, Stdio};

/// What a run of the binary printed, and how it ended.
#[derive(Debug)]
pub(crate) struct Run {
    pub(crate) status: ExitStatus,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

impl Run {
    /// stdout's lines.
    pub(crate) fn lines(&self) -> Vec<&str> {
        self.stdout.lines().collect()
    }

    /// Panics with everything printed unless the run succeeded.
    pub(crate) fn success(&self) -> &Self {
        assert!(self.status.success(), "floodgate failed: {self:#?}");
        self
    }

    /// Panics unless the run failed with `code`.
    pub(crate) fn failure(&self, code: i32) -> &Self {
        assert_eq!(self.status.code(), Some(code), "{self:#?}");
        self
    }
}

/// Runs `floodgate args...` with `stdin` as its input.
pub(crate) fn floodgate(args: &[&str], stdin: &str) -> Run {
    floodgate_env(args, stdin, &[])
}

/// [`floodgate`] with these environment variables set.
pub(crate) fn floodgate_env(args: &[&str], stdin: &str, env: &[(&str, &str)]) -> Run {
    let mut child = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("floodgate starts");
    let mut input = child.stdin.take().expect("stdin is piped");
    let text = stdin.to_owned();
    // A separate writer so that a large input cannot deadlock against a full stdout pipe; the
    // binary may exit before reading everything (a usage error), so write errors are expected.
    let writer = std::thread::spawn(move || {
        let _ = input.write_all(text.as_bytes());
    });
    let output = child.wait_with_output().expect("floodgate runs");
    writer.join().expect("stdin writer");
    Run {
        status: output.status,
        stdout: String::from_utf8(output.stdout).expect("stdout is UTF-8"),
        stderr: String::from_utf8(output.stderr).expect("stderr is UTF-8"),
    }
}
