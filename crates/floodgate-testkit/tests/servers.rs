//! Several independent servers, as Redlock tests need.

use std::collections::HashSet;

use floodgate_testkit::RedisServers;

#[test]
fn five_independent_servers_on_distinct_ports() {
    let servers = RedisServers::start(5).expect("start 5 servers");
    assert_eq!(servers.len(), 5);
    let ports: HashSet<u16> = servers.ports().into_iter().collect();
    assert_eq!(
        ports.len(),
        5,
        "ports must be distinct: {:?}",
        servers.ports()
    );
    let urls: HashSet<String> = servers.urls().into_iter().collect();
    assert_eq!(urls.len(), 5);

    for (i, server) in servers.iter().enumerate() {
        server.cmd_ok(&["SET", "id", &i.to_string()]).expect("SET");
    }
    for i in 0..servers.len() {
        let id = servers[i].cmd(&["GET", "id"]).expect("GET");
        assert_eq!(
            id.as_int(),
            Some(i64::try_from(i).expect("small")),
            "server {i}"
        );
    }

    // Faults hit one server only.
    servers[1].kill().expect("kill");
    servers[3].pause().expect("pause");
    assert!(servers[1].cmd(&["PING"]).is_err());
    assert!(
        servers[3]
            .cmd_timeout(&["PING"], std::time::Duration::from_millis(200))
            .expect_err("paused")
            .is_timeout()
    );
    for i in [0, 2, 4] {
        assert_eq!(
            servers[i].cmd(&["PING"]).expect("PING").as_str(),
            Some("PONG")
        );
    }
    servers[3].resume().expect("resume");
    servers[1].restart().expect("restart");
    for server in &servers {
        assert_eq!(server.cmd(&["PING"]).expect("PING").as_str(), Some("PONG"));
    }
    assert!(servers.get(5).is_none());
}
