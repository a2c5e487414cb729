//! `floodgate`: the command-line tool of the floodgate rate limiter.
//!
//! Each subcommand lives in its own module, with its clap arguments and a `run` function;
//! this file only wires them together and turns errors into messages and exit codes.

mod args;
mod bench;
mod check;
mod error;
mod histogram;
mod inspect;
mod plot;
mod policy_args;
mod redis_args;
mod reset;
mod simulate;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Distributed rate limiting on Redis and in memory: try policies out from the command line.
#[derive(Debug, Parser)]
#[command(name = "floodgate", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Each subcommand's help (about, long_about, after_help) is set on its Args struct: a doc
// comment here would replace the long help.
#[derive(Debug, Subcommand)]
enum Command {
    Simulate(simulate::SimulateArgs),
    Plot(plot::PlotArgs),
    Check(check::CheckArgs),
    Inspect(inspect::InspectArgs),
    Reset(reset::ResetArgs),
    Bench(bench::BenchArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Simulate(args) => simulate::run(args),
        Command::Plot(args) => plot::run(args),
        Command::Check(args) => check::run(args),
        Command::Inspect(args) => inspect::run(args),
        Command::Reset(args) => reset::run(args),
        Command::Bench(args) => bench::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => err.report(),
    }
}
