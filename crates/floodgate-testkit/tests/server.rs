//! A single real redis-server: round trips, kill/restart, pause/resume, drop.

use std::path::Path;
use std::time::Duration;

use floodgate_testkit::{Connection, RedisServer, Resp};

fn proc_exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

#[test]
fn set_get_round_trip_with_text_and_binary_values() {
    let server = RedisServer::start().expect("start redis-server");
    assert_ne!(server.port(), 0);
    assert_eq!(server.addr().port(), server.port());
    assert!(server.addr().ip().is_loopback());
    assert_eq!(server.url(), format!("redis://127.0.0.1:{}", server.port()));
    assert!(server.is_running());
    assert!(server.pid().is_some());

    assert!(server.cmd(&["SET", "k", "v"]).expect("SET").is_ok());
    assert_eq!(server.cmd(&["GET", "k"]).expect("GET").as_str(), Some("v"));
    assert!(server.cmd(&["GET", "missing"]).expect("GET").is_nil());

    let key: &[u8] = b"bin\x00key\r\n";
    let value: Vec<u8> = (0..=255u8).collect();
    let set: [&[u8]; 3] = [b"SET", key, &value];
    assert!(server.cmd(&set).expect("binary SET").is_ok());
    let get: [&[u8]; 2] = [b"GET", key];
    assert_eq!(
        server.cmd(&get).expect("binary GET"),
        Resp::Bulk(Some(value))
    );

    assert_eq!(
        server.cmd(&["INCRBY", "n", "41"]).expect("INCRBY").as_int(),
        Some(41)
    );
    assert_eq!(server.cmd(&["INCR", "n"]).expect("INCR"), Resp::Int(42));
    let list = server
        .cmd(&["RPUSH", "l", "a", "b"])
        .and_then(|_| server.cmd(&["LRANGE", "l", "0", "-1"]))
        .expect("LRANGE");
    let items: Vec<_> = list
        .as_array()
        .expect("array")
        .iter()
        .map(Resp::as_str)
        .collect();
    assert_eq!(items, [Some("a"), Some("b")]);
}

#[test]
fn error_replies_and_cmd_ok() {
    let server = RedisServer::start().expect("start");
    server.cmd_ok(&["SET", "s", "text"]).expect("SET");
    let reply = server.cmd(&["INCR", "s"]).expect("INCR reply");
    assert!(reply.is_error(), "{reply:?}");
    let err = server
        .cmd_ok(&["INCR", "s"])
        .expect_err("INCR on text must fail");
    assert!(err.is_server_error(), "{err:?}");
    assert!(err.to_string().contains("INCR"), "{err}");
    assert!(err.to_string().contains("not an integer"), "{err}");
}

#[test]
fn config_lines_apply_and_persistence_is_off() {
    let server = RedisServer::builder()
        .config("notify-keyspace-events KEA")
        .start()
        .expect("start");
    let get = |name: &str| {
        let reply = server.cmd_ok(&["CONFIG", "GET", name]).expect("CONFIG GET");
        let items = reply.into_array().expect("array");
        items
            .get(1)
            .and_then(Resp::as_str)
            .map(str::to_owned)
            .expect("value")
    };
    let events = get("notify-keyspace-events");
    for flag in ['K', 'E', 'A'] {
        assert!(events.contains(flag), "notify-keyspace-events = {events}");
    }
    assert_eq!(get("save"), "");
    assert_eq!(get("appendonly"), "no");
    assert_eq!(get("bind"), "127.0.0.1");
    assert_eq!(get("protected-mode"), "no");
    assert_eq!(get("dir"), server.dir().to_string_lossy());

    // Keyspace notifications actually arrive.
    let mut sub = server.connect().expect("connect");
    sub.cmd_ok(&["SUBSCRIBE", "__keyevent@0__:set"])
        .expect("SUBSCRIBE");
    server.cmd_ok(&["SET", "watched", "1"]).expect("SET");
    let msg = sub.read_reply().expect("notification");
    let items = msg.as_array().expect("message array");
    assert_eq!(items.first().and_then(Resp::as_str), Some("message"));
    assert_eq!(items.get(2).and_then(Resp::as_str), Some("watched"));
}

#[test]
fn password_is_required_and_used() {
    let server = RedisServer::builder()
        .password("s3cr@t")
        .start()
        .expect("start");
    assert_eq!(server.password(), Some("s3cr@t"));
    assert_eq!(
        server.url(),
        format!("redis://:s3cr%40t@127.0.0.1:{}", server.port())
    );
    assert_eq!(server.cmd(&["PING"]).expect("PING").as_str(), Some("PONG"));
    let mut anonymous = Connection::connect(server.addr()).expect("connect");
    let reply = anonymous.cmd(&["PING"]).expect("reply");
    assert!(
        reply.as_error().is_some_and(|e| e.starts_with("NOAUTH")),
        "{reply:?}"
    );
}

#[test]
fn kill_then_restart_on_the_same_port() {
    let server = RedisServer::start().expect("start");
    let port = server.port();
    let old_pid = server.pid().expect("pid");
    server.cmd_ok(&["SET", "k", "v"]).expect("SET");

    server.kill().expect("kill");
    assert!(!server.is_running());
    assert_eq!(server.pid(), None);
    assert!(
        !proc_exists(old_pid),
        "pid {old_pid} still exists after kill"
    );
    let err = server.cmd(&["PING"]).expect_err("PING to a killed server");
    assert!(err.is_connect(), "{err:?}");
    server.kill().expect("a second kill is a no-op");
    assert!(server.pause().is_err(), "pausing a killed server must fail");

    server.restart().expect("restart");
    assert_eq!(server.port(), port);
    assert!(server.is_running());
    let new_pid = server.pid().expect("pid after restart");
    assert_ne!(new_pid, old_pid);
    assert_eq!(server.cmd(&["PING"]).expect("PING").as_str(), Some("PONG"));
    assert!(
        server.cmd(&["GET", "k"]).expect("GET").is_nil(),
        "no persistence"
    );

    // Restart while running replaces the process.
    server.cmd_ok(&["SET", "k", "v2"]).expect("SET");
    server.restart().expect("restart while running");
    assert_ne!(server.pid(), Some(new_pid));
    assert!(!proc_exists(new_pid));
    assert_eq!(server.port(), port);
    assert!(server.cmd(&["GET", "k"]).expect("GET").is_nil());
}

#[test]
fn paused_server_times_out_until_resumed() {
    let server = RedisServer::start().expect("start");
    server.cmd_ok(&["SET", "k", "v"]).expect("SET");

    server.pause().expect("pause");
    assert!(server.is_paused());
    assert!(server.is_running(), "a paused server is still running");
    let err = server
        .cmd_timeout(&["GET", "k"], Duration::from_millis(200))
        .expect_err("GET while paused");
    assert!(err.is_timeout(), "expected a timeout, got {err:?}");

    server.resume().expect("resume");
    assert!(!server.is_paused());
    let reply = server
        .cmd_timeout(&["GET", "k"], Duration::from_secs(2))
        .expect("GET after resume");
    assert_eq!(reply.as_str(), Some("v"));
}

#[test]
fn restart_from_paused_state() {
    let server = RedisServer::start().expect("start");
    server.pause().expect("pause");
    server.restart().expect("restart a paused server");
    assert!(!server.is_paused());
    assert_eq!(server.cmd(&["PING"]).expect("PING").as_str(), Some("PONG"));
}

#[test]
fn drop_kills_the_process_and_removes_the_directory() {
    let server = RedisServer::start().expect("start");
    let pid = server.pid().expect("pid");
    let dir = server.dir().to_path_buf();
    assert!(proc_exists(pid));
    assert!(dir.join("redis.conf").exists());
    drop(server);
    assert!(!proc_exists(pid), "redis-server pid {pid} survived drop");
    assert!(!dir.exists(), "{} survived drop", dir.display());

    // Also when paused.
    let server = RedisServer::start().expect("start");
    let pid = server.pid().expect("pid");
    server.pause().expect("pause");
    drop(server);
    assert!(
        !proc_exists(pid),
        "paused redis-server pid {pid} survived drop"
    );
}

#[test]
fn a_panicking_test_leaves_no_server_behind() {
    let (tx, rx) = std::sync::mpsc::channel();
    let result = std::panic::catch_unwind(move || {
        let server = RedisServer::start().expect("start");
        tx.send(server.pid().expect("pid")).expect("send pid");
        panic!("test failure while the server runs");
    });
    assert!(result.is_err());
    let pid = rx.recv().expect("pid from the panicking closure");
    assert!(!proc_exists(pid), "redis-server pid {pid} survived a panic");
}

#[test]
fn startup_failure_reports_the_log_tail() {
    let err = RedisServer::builder()
        .config("this-is-not-a-directive yes")
        .start()
        .expect_err("bad config must fail");
    let msg = err.to_string();
    assert!(msg.contains("exited during startup"), "{msg}");
    assert!(msg.contains("this-is-not-a-directive"), "{msg}");
}
