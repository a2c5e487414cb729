//! A local 6-node Redis Cluster: creation, key slots, failover.

use std::time::{Duration, Instant};

use floodgate_testkit::{Connection, RedisCluster, Resp, Role, key_slot};

const HEALTHY: Duration = Duration::from_secs(30);

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(
            started.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn cluster_starts_healthy_and_key_slots_match_the_server() {
    let cluster = RedisCluster::start().expect("start cluster");
    assert_eq!(cluster.len(), 6);
    assert_eq!(cluster.urls().len(), 6);
    for (i, node) in cluster.nodes().iter().enumerate() {
        let info = node.cmd_ok(&["CLUSTER", "INFO"]).expect("CLUSTER INFO");
        let info = info.as_str().expect("text");
        assert!(info.contains("cluster_state:ok"), "node {i}: {info}");
        assert!(info.contains("cluster_slots_ok:16384"), "node {i}: {info}");
        assert_eq!(
            cluster.urls()[i],
            format!("redis://127.0.0.1:{}", node.port())
        );
    }
    let masters = cluster.masters().expect("masters");
    let replicas = cluster.replicas().expect("replicas");
    assert_eq!(masters.len(), 3, "masters: {masters:?}");
    assert_eq!(replicas.len(), 3, "replicas: {replicas:?}");
    for &m in &masters {
        assert_eq!(
            cluster.replicas_of(m).expect("replicas_of").len(),
            1,
            "master {m}"
        );
    }

    let mut keys: Vec<Vec<u8>> = [
        &b""[..],
        b"a",
        b"foo",
        b"bar",
        b"{}",
        b"{{a}}",
        b"a{b}c",
        b"{a}{b}",
        b"{}{a}",
        b"a{",
        b"a}",
        b"}{a}",
        b"{",
        b"}",
        b"{user1000}.following",
        b"{user1000}.followers",
        b"\x00\xff{\x01}\r\n",
        b"\xff\xfe\xfd",
        b"{\x00}",
        "ключ{тег}".as_bytes(),
    ]
    .iter()
    .map(|k| k.to_vec())
    .collect();
    keys.push(vec![b'x'; 1000]);
    keys.extend((0..500).map(|i| format!("key:{i}").into_bytes()));
    keys.extend((0..100).map(|i| format!("rl:{{tenant-{i}}}:window").into_bytes()));

    let mut conn = cluster.node(0).connect().expect("connect");
    for key in &keys {
        let args: [&[u8]; 3] = [b"CLUSTER", b"KEYSLOT", key];
        let server_slot = conn.cmd_ok(&args).expect("CLUSTER KEYSLOT").as_int();
        assert_eq!(
            server_slot,
            Some(i64::from(key_slot(key))),
            "slot of {:?}",
            String::from_utf8_lossy(key)
        );
        assert_eq!(RedisCluster::key_slot(key), key_slot(key));
    }

    // node_for_slot names the node that accepts the key; others redirect.
    for key in [&b"foo"[..], b"bar", b"{user1000}.following", b"\x00\xff"] {
        let owner = cluster.node_for_key(key).expect("node_for_key");
        assert!(masters.contains(&owner));
        let set: [&[u8]; 3] = [b"SET", key, b"v"];
        assert!(cluster.node(owner).cmd(&set).expect("SET").is_ok());
        let other = masters
            .iter()
            .copied()
            .find(|&m| m != owner)
            .expect("other master");
        let reply = cluster.node(other).cmd(&set).expect("SET elsewhere");
        let expected = format!(
            "MOVED {} 127.0.0.1:{}",
            key_slot(key),
            cluster.node(owner).port()
        );
        assert_eq!(reply.as_error(), Some(expected.as_str()));
    }
    assert!(cluster.node_for_slot(16384).is_err());
}

#[test]
fn killed_master_is_replaced_by_its_replica() {
    let cluster = RedisCluster::start().expect("start cluster");
    let slot = key_slot(b"{victim}");
    let old_master = cluster.node_for_slot(slot).expect("owner");
    let replica = cluster.replicas_of(old_master).expect("replicas_of")[0];
    cluster
        .node(old_master)
        .cmd_ok(&["SET", "{victim}", "before"])
        .expect("SET");
    // Make sure the write reached the replica before the master dies.
    let acked = cluster
        .node(old_master)
        .cmd_ok(&["WAIT", "1", "5000"])
        .expect("WAIT");
    assert_eq!(acked.as_int(), Some(1));

    let killed = cluster.kill_master_for_slot(slot).expect("kill master");
    assert_eq!(killed, old_master);
    assert!(!cluster.node(killed).is_running());
    assert!(cluster.node(killed).cmd(&["PING"]).is_err());

    cluster.failover(replica).expect("failover");
    assert_eq!(cluster.role(replica).expect("role"), Role::Master);
    cluster
        .wait_healthy(HEALTHY)
        .expect("healthy after failover");
    assert_eq!(cluster.node_for_slot(slot).expect("new owner"), replica);
    assert_eq!(cluster.masters().expect("masters").len(), 3);
    assert_eq!(cluster.replicas().expect("replicas").len(), 2);
    let value = cluster
        .node(replica)
        .cmd(&["GET", "{victim}"])
        .expect("GET");
    assert_eq!(value.as_str(), Some("before"));

    // The old master comes back as a replica of the promoted node.
    cluster.node(killed).restart().expect("restart old master");
    let promoted_port = cluster.node(replica).port();
    wait_for("the old master to rejoin as a replica", HEALTHY, || {
        cluster.role(killed).ok()
            == Some(Role::Replica {
                master_port: promoted_port,
            })
    });
    cluster.wait_healthy(HEALTHY).expect("healthy after rejoin");
    assert_eq!(cluster.replicas().expect("replicas").len(), 3);
}

#[test]
fn coordinated_failover_and_automatic_failover_of_a_paused_master() {
    let cluster = RedisCluster::start().expect("start cluster");
    let masters = cluster.masters().expect("masters");

    // Coordinated failover: roles swap, nobody dies.
    let master = masters[0];
    let replica = cluster.replicas_of(master).expect("replicas_of")[0];
    cluster.failover(replica).expect("coordinated failover");
    assert_eq!(cluster.role(replica).expect("role"), Role::Master);
    wait_for("the old master to become a replica", HEALTHY, || {
        cluster.role(master).ok()
            == Some(Role::Replica {
                master_port: cluster.node(replica).port(),
            })
    });
    cluster
        .wait_healthy(HEALTHY)
        .expect("healthy after coordinated failover");

    // A paused master is detected after cluster-node-timeout and its
    // replica is promoted automatically.
    let master = masters[1];
    let replica = cluster.replicas_of(master).expect("replicas_of")[0];
    cluster.node(master).pause().expect("pause");
    wait_for("automatic failover", HEALTHY, || {
        cluster.role(replica).ok() == Some(Role::Master)
    });
    cluster
        .wait_healthy(HEALTHY)
        .expect("healthy with a paused node");
    cluster.node(master).resume().expect("resume");
    wait_for("the resumed master to step down", HEALTHY, || {
        matches!(cluster.role(master), Ok(Role::Replica { .. }))
    });
    cluster.wait_healthy(HEALTHY).expect("healthy after resume");
    assert_eq!(cluster.masters().expect("masters").len(), 3);
    assert_eq!(cluster.replicas().expect("replicas").len(), 3);

    // Every node still answers; the cluster serves a key end to end.
    let owner = cluster.node_for_key(b"k").expect("owner");
    let mut conn = Connection::connect(cluster.node(owner).addr()).expect("connect");
    assert!(conn.cmd(&["SET", "k", "v"]).expect("SET").is_ok());
    assert_eq!(
        conn.cmd(&["GET", "k"]).expect("GET"),
        Resp::Bulk(Some(b"v".to_vec()))
    );
}
