//! Several independent standalone servers (e.g. for Redlock).

use std::ops::Index;

use crate::TestkitError;
use crate::server::{RedisServer, RedisServerBuilder};

/// `n` independent standalone [`RedisServer`]s, each on its own port and in
/// its own directory. Index it (`servers[2].kill()`) to inject faults into
/// one of them. Dropping it kills them all.
#[derive(Debug)]
pub struct RedisServers {
    servers: Vec<RedisServer>,
}

impl RedisServers {
    /// Starts `n` servers with default options.
    ///
    /// # Errors
    /// As [`RedisServerBuilder::start`]; servers already started are killed.
    pub fn start(n: usize) -> Result<Self, TestkitError> {
        Self::start_with(n, &RedisServer::builder())
    }

    /// Starts `n` servers, each from `builder`.
    ///
    /// # Errors
    /// As [`RedisServerBuilder::start`]; servers already started are killed.
    pub fn start_with(n: usize, builder: &RedisServerBuilder) -> Result<Self, TestkitError> {
        let servers = (0..n)
            .map(|_| builder.start())
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self { servers })
    }

    /// Number of servers.
    pub fn len(&self) -> usize {
        self.servers.len()
    }

    /// True if there are no servers.
    pub fn is_empty(&self) -> bool {
        self.servers.is_empty()
    }

    /// The server at `index`, if any.
    pub fn get(&self, index: usize) -> Option<&RedisServer> {
        self.servers.get(index)
    }

    /// All servers.
    pub fn servers(&self) -> &[RedisServer] {
        &self.servers
    }

    /// Iterates over the servers.
    pub fn iter(&self) -> std::slice::Iter<'_, RedisServer> {
        self.servers.iter()
    }

    /// Every server's URL.
    pub fn urls(&self) -> Vec<String> {
        self.servers.iter().map(RedisServer::url).collect()
    }

    /// Every server's port.
    pub fn ports(&self) -> Vec<u16> {
        self.servers.iter().map(RedisServer::port).collect()
    }
}

impl Index<usize> for RedisServers {
    type Output = RedisServer;

    fn index(&self, index: usize) -> &RedisServer {
        &self.servers[index]
    }
}

impl<'a> IntoIterator for &'a RedisServers {
    type Item = &'a RedisServer;
    type IntoIter = std::slice::Iter<'a, RedisServer>;

    fn into_iter(self) -> Self::IntoIter {
        self.servers.iter()
    }
}
