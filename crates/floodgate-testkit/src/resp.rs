//! A tiny synchronous RESP2 client, for test setup and assertions.

use std::io::{self, BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use crate::TestkitError;

/// Default timeout for connecting.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Default timeout for reading a reply or writing a command.
pub const DEFAULT_IO_TIMEOUT: Duration = Duration::from_secs(5);

/// Largest bulk string or array we accept (guards against garbage lengths).
const MAX_LEN: i64 = 512 * 1024 * 1024;

/// A RESP2 reply.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Resp {
    /// `+OK`
    Simple(String),
    /// `-ERR ...`
    Error(String),
    /// `:42`
    Int(i64),
    /// `$3\r\nfoo` or `$-1` (nil).
    Bulk(Option<Vec<u8>>),
    /// `*2\r\n...` or `*-1` (nil).
    Array(Option<Vec<Resp>>),
}

impl Resp {
    /// The integer of an `Int` reply, or of a bulk/simple string holding a
    /// decimal integer (as `GET` returns for counters).
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Self::Int(i) => Some(*i),
            Self::Simple(s) => s.parse().ok(),
            Self::Bulk(Some(b)) => std::str::from_utf8(b).ok()?.parse().ok(),
            _ => None,
        }
    }

    /// The text of a simple string, or of a bulk string that is valid UTF-8.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::Simple(s) => Some(s),
            Self::Bulk(Some(b)) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }

    /// The bytes of a bulk or simple string.
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            Self::Simple(s) => Some(s.as_bytes()),
            Self::Bulk(Some(b)) => Some(b),
            _ => None,
        }
    }

    /// The elements of a non-nil array.
    pub fn as_array(&self) -> Option<&[Resp]> {
        match self {
            Self::Array(Some(items)) => Some(items),
            _ => None,
        }
    }

    /// Consumes a non-nil array into its elements.
    pub fn into_array(self) -> Option<Vec<Resp>> {
        match self {
            Self::Array(Some(items)) => Some(items),
            _ => None,
        }
    }

    /// The message of an error reply.
    pub fn as_error(&self) -> Option<&str> {
        match self {
            Self::Error(e) => Some(e),
            _ => None,
        }
    }

    /// True for an error reply.
    pub fn is_error(&self) -> bool {
        matches!(self, Self::Error(_))
    }

    /// True for a nil bulk string or nil array.
    pub fn is_nil(&self) -> bool {
        matches!(self, Self::Bulk(None) | Self::Array(None))
    }

    /// True for the simple string `OK`.
    pub fn is_ok(&self) -> bool {
        matches!(self, Self::Simple(s) if s == "OK")
    }
}

/// Encodes a command as a RESP2 array of bulk strings.
pub fn encode_command<A: AsRef<[u8]>>(args: &[A]) -> Vec<u8> {
    let mut out =
        Vec::with_capacity(16 + args.iter().map(|a| a.as_ref().len() + 16).sum::<usize>());
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for arg in args {
        let arg = arg.as_ref();
        out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// The command name (first argument) as text, for error messages.
pub(crate) fn command_name<A: AsRef<[u8]>>(args: &[A]) -> String {
    args.first()
        .map(|a| String::from_utf8_lossy(a.as_ref()).into_owned())
        .unwrap_or_default()
}

/// One synchronous connection to a Redis server.
///
/// Every read and write is bounded by a timeout (see [`Connection::set_timeout`]).
#[derive(Debug)]
pub struct Connection {
    addr: String,
    reader: BufReader<TcpStream>,
    timeout: Duration,
}

impl Connection {
    /// Connects to `addr` with [`DEFAULT_CONNECT_TIMEOUT`] and
    /// [`DEFAULT_IO_TIMEOUT`].
    ///
    /// # Errors
    /// [`TestkitError::Connect`] if the TCP connection cannot be made.
    pub fn connect(addr: SocketAddr) -> Result<Self, TestkitError> {
        Self::connect_with(addr, DEFAULT_CONNECT_TIMEOUT, DEFAULT_IO_TIMEOUT)
    }

    /// Connects to `addr` with the given connect and read/write timeouts.
    ///
    /// # Errors
    /// [`TestkitError::Connect`] if the TCP connection cannot be made.
    pub fn connect_with(
        addr: SocketAddr,
        connect_timeout: Duration,
        io_timeout: Duration,
    ) -> Result<Self, TestkitError> {
        let addr_text = addr.to_string();
        let stream = TcpStream::connect_timeout(&addr, connect_timeout).map_err(|source| {
            TestkitError::Connect {
                addr: addr_text.clone(),
                source,
            }
        })?;
        let _ = stream.set_nodelay(true);
        let mut conn = Self {
            addr: addr_text,
            reader: BufReader::new(stream),
            timeout: io_timeout,
        };
        conn.set_timeout(io_timeout)?;
        Ok(conn)
    }

    /// The address this connection talks to.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Sets the read and write timeout for later commands.
    ///
    /// # Errors
    /// [`TestkitError::InvalidArgument`] for a zero timeout, or an I/O error.
    pub fn set_timeout(&mut self, timeout: Duration) -> Result<(), TestkitError> {
        if timeout.is_zero() {
            return Err(TestkitError::InvalidArgument(
                "connection timeout must be greater than zero".to_owned(),
            ));
        }
        let stream = self.reader.get_ref();
        stream
            .set_read_timeout(Some(timeout))
            .and_then(|()| stream.set_write_timeout(Some(timeout)))
            .map_err(|source| TestkitError::Io {
                addr: self.addr.clone(),
                op: "set timeout".to_owned(),
                source,
            })?;
        self.timeout = timeout;
        Ok(())
    }

    /// Sends a command and reads its reply. An error reply is returned as
    /// `Ok(Resp::Error(..))`; use [`Connection::cmd_ok`] to turn it into an `Err`.
    ///
    /// # Errors
    /// Timeouts ([`TestkitError::is_timeout`]), I/O and protocol errors.
    pub fn cmd<A: AsRef<[u8]>>(&mut self, args: &[A]) -> Result<Resp, TestkitError> {
        self.send(args)?;
        let name = command_name(args);
        self.read_reply_for(&name)
    }

    /// Like [`Connection::cmd`], but an error reply becomes
    /// [`TestkitError::ServerError`].
    ///
    /// # Errors
    /// As [`Connection::cmd`], plus [`TestkitError::ServerError`].
    pub fn cmd_ok<A: AsRef<[u8]>>(&mut self, args: &[A]) -> Result<Resp, TestkitError> {
        match self.cmd(args)? {
            Resp::Error(message) => Err(TestkitError::ServerError {
                addr: self.addr.clone(),
                command: command_name(args),
                message,
            }),
            other => Ok(other),
        }
    }

    /// Sends a command without reading the reply (for pipelining, or
    /// `SUBSCRIBE` followed by [`Connection::read_reply`]).
    ///
    /// # Errors
    /// Timeouts and I/O errors.
    pub fn send<A: AsRef<[u8]>>(&mut self, args: &[A]) -> Result<(), TestkitError> {
        if args.is_empty() {
            return Err(TestkitError::InvalidArgument(
                "a command needs at least one argument".to_owned(),
            ));
        }
        let bytes = encode_command(args);
        let name = command_name(args);
        let stream = self.reader.get_mut();
        stream
            .write_all(&bytes)
            .and_then(|()| stream.flush())
            .map_err(|e| io_error(&self.addr, format!("write of `{name}`"), self.timeout, e))
    }

    /// Reads the next reply (e.g. a pub/sub message).
    ///
    /// # Errors
    /// Timeouts, I/O and protocol errors.
    pub fn read_reply(&mut self) -> Result<Resp, TestkitError> {
        self.read_reply_for("reply")
    }

    fn read_reply_for(&mut self, what: &str) -> Result<Resp, TestkitError> {
        let timeout = self.timeout;
        let addr = self.addr.clone();
        read_value(&mut self.reader, 0).map_err(|e| match e {
            ReadError::Io(e) => io_error(&addr, format!("read of `{what}` reply"), timeout, e),
            ReadError::Protocol(detail) => TestkitError::Protocol { addr, detail },
        })
    }
}

fn io_error(addr: &str, op: String, timeout: Duration, e: io::Error) -> TestkitError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => TestkitError::Timeout {
            addr: addr.to_owned(),
            op,
            timeout,
        },
        _ => TestkitError::Io {
            addr: addr.to_owned(),
            op,
            source: e,
        },
    }
}

enum ReadError {
    Io(io::Error),
    Protocol(String),
}

impl From<io::Error> for ReadError {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

fn read_line<R: BufRead>(r: &mut R) -> Result<Vec<u8>, ReadError> {
    let mut line = Vec::new();
    let n = r.read_until(b'\n', &mut line)?;
    if n == 0 {
        return Err(ReadError::Io(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed by server",
        )));
    }
    if !line.ends_with(b"\r\n") {
        return Err(ReadError::Protocol(format!(
            "line not terminated by CRLF: {:?}",
            String::from_utf8_lossy(&line)
        )));
    }
    line.truncate(line.len() - 2);
    Ok(line)
}

fn parse_len(bytes: &[u8]) -> Result<i64, ReadError> {
    std::str::from_utf8(bytes)
        .ok()
        .and_then(|s| s.parse::<i64>().ok())
        .filter(|n| (-1..=MAX_LEN).contains(n))
        .ok_or_else(|| {
            ReadError::Protocol(format!("bad length {:?}", String::from_utf8_lossy(bytes)))
        })
}

fn read_value<R: BufRead>(r: &mut R, depth: usize) -> Result<Resp, ReadError> {
    if depth > 64 {
        return Err(ReadError::Protocol("replies nested too deep".to_owned()));
    }
    let line = read_line(r)?;
    let Some((&kind, rest)) = line.split_first() else {
        return Err(ReadError::Protocol("empty line".to_owned()));
    };
    let text = || String::from_utf8_lossy(rest).into_owned();
    match kind {
        b'+' => Ok(Resp::Simple(text())),
        b'-' => Ok(Resp::Error(text())),
        b':' => std::str::from_utf8(rest)
            .ok()
            .and_then(|s| s.parse().ok())
            .map(Resp::Int)
            .ok_or_else(|| ReadError::Protocol(format!("bad integer {:?}", text()))),
        b'$' => {
            let len = parse_len(rest)?;
            let Ok(len) = usize::try_from(len) else {
                return Ok(Resp::Bulk(None));
            };
            let mut buf = vec![0; len + 2];
            r.read_exact(&mut buf)?;
            if !buf.ends_with(b"\r\n") {
                return Err(ReadError::Protocol(
                    "bulk string not terminated by CRLF".to_owned(),
                ));
            }
            buf.truncate(len);
            Ok(Resp::Bulk(Some(buf)))
        }
        b'*' => {
            let len = parse_len(rest)?;
            let Ok(len) = usize::try_from(len) else {
                return Ok(Resp::Array(None));
            };
            let mut items = Vec::with_capacity(len.min(1024));
            for _ in 0..len {
                items.push(read_value(r, depth + 1)?);
            }
            Ok(Resp::Array(Some(items)))
        }
        other => Err(ReadError::Protocol(format!(
            "unknown reply type byte {:?}",
            char::from(other)
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(bytes: &[u8]) -> Result<Resp, ReadError> {
        read_value(&mut io::Cursor::new(bytes), 0)
    }

    fn ok(bytes: &[u8]) -> Resp {
        match parse(bytes) {
            Ok(v) => v,
            Err(ReadError::Io(e)) => panic!("io error {e}"),
            Err(ReadError::Protocol(p)) => panic!("protocol error {p}"),
        }
    }

    #[test]
    fn encodes_binary_args() {
        let args: [&[u8]; 2] = [b"SET", b"a\r\n\0"];
        assert_eq!(
            encode_command(&args),
            b"*2\r\n$3\r\nSET\r\n$4\r\na\r\n\0\r\n"
        );
    }

    #[test]
    fn parses_every_type() {
        assert_eq!(ok(b"+OK\r\n"), Resp::Simple("OK".into()));
        assert!(ok(b"+OK\r\n").is_ok());
        assert_eq!(ok(b"-ERR no\r\n").as_error(), Some("ERR no"));
        assert_eq!(ok(b":-42\r\n").as_int(), Some(-42));
        assert_eq!(ok(b"$-1\r\n"), Resp::Bulk(None));
        assert!(ok(b"*-1\r\n").is_nil());
        assert_eq!(ok(b"$4\r\na\r\nb\r\n").as_bytes(), Some(&b"a\r\nb"[..]));
        assert_eq!(ok(b"$2\r\n17\r\n").as_int(), Some(17));
        let arr = ok(b"*3\r\n:1\r\n$1\r\nx\r\n*0\r\n");
        let items = arr.as_array().expect("array");
        assert_eq!(items.len(), 3);
        assert_eq!(items[1].as_str(), Some("x"));
        assert_eq!(items[2], Resp::Array(Some(vec![])));
    }

    #[test]
    fn rejects_garbage() {
        assert!(matches!(parse(b"?x\r\n"), Err(ReadError::Protocol(_))));
        assert!(matches!(parse(b":x\r\n"), Err(ReadError::Protocol(_))));
        assert!(matches!(parse(b"$-5\r\n"), Err(ReadError::Protocol(_))));
        assert!(matches!(parse(b"+OK\n"), Err(ReadError::Protocol(_))));
        assert!(matches!(parse(b"$3\r\nab"), Err(ReadError::Io(_))));
    }
}
