use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use floodgate::tower::key::{ClientIp, TrustedProxies};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use sms_gateway::app::{App, Limits, router};
use sms_gateway::config::{Cli, Config};
use sms_gateway::provider::{FileProvider, PauseWhenBusy, SmsProvider, WebhookProvider};
use sms_gateway::server::{ServeLimits, serve as serve_http};
use sms_gateway::shared::{MemoryShared, RedisShared, Shared};
use tokio::sync::{Notify, watch};

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let mut config = match Config::load(Cli::parse()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("sms-gateway: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = sms_gateway::open_files::fit(&mut config) {
        eprintln!("sms-gateway: {e}");
        return ExitCode::FAILURE;
    }
    match start(config).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sms-gateway: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn start(config: Config) -> Result<(), String> {
    let metrics = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| format!("metrics: {e}"))?;
    let provider: Arc<dyn SmsProvider> = match &config.webhook_url {
        Some(url) => WebhookProvider::new(url).map_err(|e| e.to_string())?,
        None => FileProvider::new(&config.outbox_path),
    };
    // A busy provider's pause holds every message back, not only the one it turned away.
    let provider: Arc<dyn SmsProvider> = PauseWhenBusy::new(provider);
    match config.redis_url.clone() {
        None => {
            let shared =
                MemoryShared::with_max_keys(config.memory_max_keys).map_err(|e| e.to_string())?;
            serve(config, shared, provider, metrics).await
        }
        Some(url) => {
            let shared = RedisShared::connect(&url, &config.redis_prefix)
                .await
                .map_err(|e| format!("cannot use Redis: {e}"))?;
            serve(config, shared, provider, metrics).await
        }
    }
}

async fn serve<S: Shared>(
    config: Config,
    shared: S,
    provider: Arc<dyn SmsProvider>,
    metrics: PrometheusHandle,
) -> Result<(), String>
where
    floodgate::lock::Error: From<<S::Locks as floodgate::LockStore>::Error>,
{
    let limits = Limits::from_config(&config).map_err(|e| format!("limits: {e}"))?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.listen))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("cannot read the bound address: {e}"))?;
    let client_ip = ClientIp::new(TrustedProxies::new(config.trusted_proxies.iter().copied()));
    let app = Arc::new(App {
        config,
        shared,
        limits,
        provider,
        client_ip,
        metrics,
        new_campaign: Notify::new(),
        sends: Arc::default(),
    });
    let router = router(Arc::clone(&app)).map_err(|e| format!("rate-limit layer: {e}"))?;
    let (stop, stopped) = watch::channel(false);
    let dispatcher = tokio::spawn(sms_gateway::dispatcher::run(Arc::clone(&app), stopped));
    tracing::info!(
        instance = %app.config.instance_id,
        store = if app.config.redis_url.is_some() { "redis" } else { "memory" },
        outbox = %app.config.outbox_path.display(),
        "sms-gateway listening on http://{addr}"
    );
    println!("listening on http://{addr}");
    let limits = ServeLimits::from_config(&app.config);
    // The dispatcher stops at the signal, its last number sent while requests finish.
    let signal = async {
        shutdown_signal().await;
        let _ = stop.send(true);
    };
    serve_http(listener, router, limits, signal).await;
    // Messages still being sent and campaigns being created for clients that hung up:
    // recorded before we go.
    if !app.sends.idle(Duration::from_secs(10)).await {
        tracing::warn!("stopping with messages still being sent or campaigns being created");
    }
    let _ = stop.send(true);
    let _ = dispatcher.await;
    tracing::info!("sms-gateway stopped");
    Ok(())
}

/// SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
    tracing::info!("shutting down");
}
