//! A missing redis binary fails with a message that says how to install it.

use floodgate_testkit::{RedisCluster, RedisServer, RedisServers};

#[test]
fn missing_server_binary_says_to_run_install_script() {
    let err = RedisServer::builder()
        .binary("/nonexistent/redis-server")
        .start()
        .expect_err("a nonexistent binary cannot start");
    assert!(err.is_binary_not_found(), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("scripts/install-redis"), "{msg}");
    assert!(msg.contains("/nonexistent/redis-server"), "{msg}");
    assert!(msg.contains("FLOODGATE_REDIS_SERVER"), "{msg}");

    let err = RedisServers::start_with(3, &RedisServer::builder().binary("/nonexistent"))
        .expect_err("servers");
    assert!(err.to_string().contains("scripts/install-redis"), "{err}");
}

#[test]
fn missing_cli_binary_says_to_run_install_script() {
    let err = RedisCluster::builder()
        .cli("/nonexistent/redis-cli")
        .start()
        .expect_err("a nonexistent redis-cli cannot create a cluster");
    assert!(err.is_binary_not_found(), "{err:?}");
    let msg = err.to_string();
    assert!(msg.starts_with("redis-cli not found"), "{msg}");
    assert!(msg.contains("scripts/install-redis"), "{msg}");
    assert!(msg.contains("FLOODGATE_REDIS_CLI"), "{msg}");
}

#[test]
fn installed_binaries_are_found() {
    // The environment is read at call time; with nothing overridden the
    // binaries installed by scripts/install-redis are found.
    let server = floodgate_testkit::redis_server_binary().expect("redis-server");
    assert!(
        server.ends_with("redis-server") || std::env::var_os("FLOODGATE_REDIS_SERVER").is_some()
    );
    floodgate_testkit::redis_cli_binary().expect("redis-cli");
}
