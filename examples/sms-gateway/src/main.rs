use clap::Parser;

fn main() {
    let cli = sms_gateway::config::Cli::parse();
    if let Err(e) = sms_gateway::config::Config::load(cli) {
        eprintln!("sms-gateway: {e}");
        std::process::exit(2);
    }
}
