//! A minimal HTTP/1.1 client for JSON POSTs to a reward server: plain `http://` only, one
//! request per connection (`Connection: close`), every step bounded by one deadline.
//!
//! Written on `std::net` so the crate needs no HTTP stack; a reward server is a local or
//! cluster-internal endpoint, and TLS belongs in a proxy in front of it.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Largest response accepted (head and body), so a misbehaving server cannot exhaust memory.
const MAX_RESPONSE_BYTES: usize = 64 << 20;
/// Largest response head (status line and headers).
const MAX_HEAD_BYTES: usize = 64 << 10;

/// Where requests go: parsed from `http://host[:port]/path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Host as it goes into the `Host` header (IPv6 literals keep their brackets).
    host_header: String,
    /// Host as it is resolved (IPv6 literals without brackets).
    host: String,
    port: u16,
    /// Path and query, starting with `/`.
    path: String,
}

impl Endpoint {
    /// Parses a plain-HTTP URL. The error says what is wrong with it.
    pub fn parse(url: &str) -> Result<Endpoint, String> {
        let url = url.trim();
        let scheme_end = url
            .find("://")
            .ok_or_else(|| format!("'{url}' is not a URL; expected http://host[:port]/path"))?;
        let scheme = url[..scheme_end].to_ascii_lowercase();
        if scheme == "https" {
            return Err(format!(
                "'{url}' uses https, which remote_rm does not speak: point it at a plain-HTTP \
                 endpoint (http://…) or at a local proxy that forwards to the HTTPS server"
            ));
        }
        if scheme != "http" {
            return Err(format!("'{url}': only http:// URLs are supported, not {scheme}://"));
        }
        let rest = &url[scheme_end + 3..];
        let rest = rest.split('#').next().unwrap_or(rest);
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, path) = rest.split_at(authority_end);
        let path = match path {
            "" => "/".to_string(),
            p if p.starts_with('?') => format!("/{p}"),
            p => p.to_string(),
        };
        if authority.contains('@') {
            return Err(format!("'{url}': credentials in the URL are not supported"));
        }
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (host, after) = v6
                .split_once(']')
                .ok_or_else(|| format!("'{url}': unclosed '[' in the IPv6 address"))?;
            let port =
                match after {
                    "" => None,
                    p => Some(p.strip_prefix(':').ok_or_else(|| {
                        format!("'{url}': expected ':port' after the IPv6 address")
                    })?),
                };
            (host, port)
        } else {
            match authority.rsplit_once(':') {
                Some((host, port)) => (host, Some(port)),
                None => (authority, None),
            }
        };
        if host.is_empty() {
            return Err(format!("'{url}' has no host"));
        }
        let port = match port {
            None => 80,
            Some(p) => p
                .parse::<u16>()
                .ok()
                .filter(|&p| p != 0)
                .ok_or_else(|| format!("'{url}': port '{p}' is not a number in 1..=65535"))?,
        };
        let bracketed = authority.starts_with('[');
        let host_only = if bracketed { format!("[{host}]") } else { host.to_string() };
        let host_header = if port == 80 { host_only } else { format!("{host_only}:{port}") };
        Ok(Endpoint { host_header, host: host.to_string(), port, path })
    }
}

/// Why one request failed, and whether trying again could help.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// Connection errors, timeouts, 5xx and 429: worth another attempt.
    Transient(String),
    /// The server understood and refused (4xx), or answered something unusable.
    Permanent(String),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Transient(m) | Failure::Permanent(m) => f.write_str(m),
        }
    }
}

/// A response with a 2xx status.
#[derive(Debug)]
pub struct Response {
    pub body: Vec<u8>,
}

/// POSTs `body` as JSON to `endpoint`; connecting, sending and receiving must all finish within
/// `timeout`. Non-2xx statuses are failures (5xx and 429 transient).
pub fn post_json(endpoint: &Endpoint, body: &[u8], timeout: Duration) -> Result<Response, Failure> {
    let deadline = Instant::now() + timeout;
    let mut stream = connect(endpoint, deadline, timeout)?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         Accept: application/json\r\nContent-Length: {len}\r\nConnection: close\r\n\
         User-Agent: miles-rs/{version}\r\n\r\n",
        path = endpoint.path,
        host = endpoint.host_header,
        len = body.len(),
        version = env!("CARGO_PKG_VERSION"),
    );
    let send = |stream: &mut TcpStream| -> io::Result<()> {
        stream.set_write_timeout(Some(remaining(deadline)?))?;
        stream.write_all(head.as_bytes())?;
        stream.set_write_timeout(Some(remaining(deadline)?))?;
        stream.write_all(body)?;
        stream.flush()
    };
    send(&mut stream).map_err(|e| io_failure("sending the request", &e, timeout))?;
    let mut reader = Reader { stream, deadline, timeout, buf: Vec::new(), pos: 0, eof: false };
    let Head { status, reason, headers } = loop {
        let head = reader.read_head()?;
        // 1xx interim answers (100 Continue) precede the real one.
        if !(100..200).contains(&head.status) || head.status == 101 {
            break head;
        }
    };
    let header = |name: &str| {
        headers.iter().rev().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    };
    let chunked = header("transfer-encoding")
        .is_some_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case("chunked")));
    let body = if status == 204 || status == 304 {
        Vec::new()
    } else if chunked {
        reader.read_chunked()?
    } else if let Some(length) = header("content-length") {
        let length: usize = length.trim().parse().map_err(|_| {
            Failure::Permanent(format!("the server sent an invalid Content-Length '{length}'"))
        })?;
        if length > MAX_RESPONSE_BYTES {
            return Err(Failure::Permanent(format!(
                "the answer is {length} bytes, more than the {MAX_RESPONSE_BYTES} accepted"
            )));
        }
        reader.read_exact(length)?
    } else {
        reader.read_to_end()?
    };
    if (200..300).contains(&status) {
        return Ok(Response { body });
    }
    let snippet = snippet(&body);
    let message = if snippet.is_empty() {
        format!("HTTP {status} {reason}")
    } else {
        format!("HTTP {status} {reason}: {snippet}")
    };
    if status >= 500 || status == 429 {
        Err(Failure::Transient(message))
    } else {
        Err(Failure::Permanent(message))
    }
}

/// The first 200 characters of a body, on one line, for error messages.
pub fn snippet(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let mut short: String = text.trim().chars().take(200).collect();
    if text.trim().chars().count() > 200 {
        short.push('…');
    }
    short.replace(['\n', '\r'], " ")
}

/// Time left before `deadline`, or a timeout error when none is.
fn remaining(deadline: Instant) -> io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left < Duration::from_millis(1) {
        Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"))
    } else {
        Ok(left)
    }
}

/// A readable sentence for an I/O error; every I/O error is worth a retry.
fn io_failure(during: &str, e: &io::Error, timeout: Duration) -> Failure {
    let what = match e.kind() {
        io::ErrorKind::ConnectionRefused => "connection refused".to_string(),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => {
            format!("no answer within {}s", timeout.as_secs_f64())
        }
        io::ErrorKind::ConnectionReset => format!("connection reset while {during}"),
        io::ErrorKind::UnexpectedEof => format!("the server closed the connection while {during}"),
        _ => format!("{e} while {during}"),
    };
    Failure::Transient(what)
}

fn connect(
    endpoint: &Endpoint,
    deadline: Instant,
    timeout: Duration,
) -> Result<TcpStream, Failure> {
    let addrs: Vec<SocketAddr> = (endpoint.host.as_str(), endpoint.port)
        .to_socket_addrs()
        .map_err(|e| Failure::Transient(format!("cannot resolve '{}': {e}", endpoint.host)))?
        .collect();
    let mut last = None;
    for addr in &addrs {
        let attempt = remaining(deadline).and_then(|left| TcpStream::connect_timeout(addr, left));
        match attempt {
            Ok(stream) => {
                // Small request/answer pairs: do not wait to coalesce packets.
                let _ = stream.set_nodelay(true);
                return Ok(stream);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(match last {
        Some(e) => io_failure("connecting", &e, timeout),
        None => Failure::Transient(format!("'{}' resolved to no address", endpoint.host)),
    })
}

/// A response's status line and headers.
struct Head {
    status: u16,
    reason: String,
    headers: Vec<(String, String)>,
}

/// Buffered reads from the connection, each bounded by what is left of the deadline.
struct Reader {
    stream: TcpStream,
    deadline: Instant,
    timeout: Duration,
    buf: Vec<u8>,
    pos: usize,
    eof: bool,
}

impl Reader {
    /// Reads more bytes into the buffer; `false` at end of stream.
    fn fill(&mut self, during: &str) -> Result<bool, Failure> {
        if self.eof {
            return Ok(false);
        }
        if self.buf.len() > MAX_RESPONSE_BYTES {
            return Err(Failure::Permanent(format!(
                "the answer is more than the {MAX_RESPONSE_BYTES} bytes accepted"
            )));
        }
        let fail = |e: io::Error| io_failure(during, &e, self.timeout);
        let left = remaining(self.deadline).map_err(fail)?;
        self.stream.set_read_timeout(Some(left)).map_err(fail)?;
        let mut chunk = [0u8; 16 * 1024];
        loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => {
                    self.eof = true;
                    return Ok(false);
                }
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    return Ok(true);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_failure(during, &e, self.timeout)),
            }
        }
    }

    /// One line without its `\r\n` (or `\n`).
    fn read_line(&mut self, during: &str) -> Result<String, Failure> {
        loop {
            if let Some(i) = self.buf[self.pos..].iter().position(|&b| b == b'\n') {
                let line = &self.buf[self.pos..self.pos + i];
                let line = line.strip_suffix(b"\r").unwrap_or(line);
                let line = String::from_utf8_lossy(line).into_owned();
                self.pos += i + 1;
                return Ok(line);
            }
            if self.buf.len() - self.pos > MAX_HEAD_BYTES {
                return Err(Failure::Permanent(format!(
                    "a line longer than {MAX_HEAD_BYTES} bytes while {during}"
                )));
            }
            if !self.fill(during)? {
                return Err(Failure::Transient(format!(
                    "the server closed the connection while {during}"
                )));
            }
        }
    }

    /// Status code, reason phrase and headers of one response head.
    fn read_head(&mut self) -> Result<Head, Failure> {
        let during = "reading the answer";
        let status_line = self.read_line(during)?;
        let mut parts = status_line.splitn(3, ' ');
        let version = parts.next().unwrap_or("");
        let status = parts.next().and_then(|s| s.parse::<u16>().ok());
        let (true, Some(status)) = (version.starts_with("HTTP/"), status) else {
            return Err(Failure::Permanent(format!(
                "the server did not answer HTTP (first line: '{}')",
                snippet(status_line.as_bytes())
            )));
        };
        let reason = parts.next().unwrap_or("").trim().to_string();
        let mut headers = Vec::new();
        let mut head_bytes = status_line.len();
        loop {
            let line = self.read_line(during)?;
            if line.is_empty() {
                break;
            }
            head_bytes += line.len();
            if head_bytes > MAX_HEAD_BYTES {
                return Err(Failure::Permanent(format!(
                    "the answer's headers exceed {MAX_HEAD_BYTES} bytes"
                )));
            }
            if let Some((name, value)) = line.split_once(':') {
                headers.push((name.trim().to_string(), value.trim().to_string()));
            }
        }
        Ok(Head { status, reason, headers })
    }

    fn read_exact(&mut self, n: usize) -> Result<Vec<u8>, Failure> {
        while self.buf.len() - self.pos < n {
            if !self.fill("reading the answer")? {
                return Err(Failure::Transient(format!(
                    "the server closed the connection after {} of {n} body bytes",
                    self.buf.len() - self.pos
                )));
            }
        }
        let out = self.buf[self.pos..self.pos + n].to_vec();
        self.pos += n;
        Ok(out)
    }

    fn read_to_end(&mut self) -> Result<Vec<u8>, Failure> {
        while self.fill("reading the answer")? {}
        let out = self.buf[self.pos..].to_vec();
        self.pos = self.buf.len();
        Ok(out)
    }

    /// A `Transfer-Encoding: chunked` body: hex sizes (extensions ignored), data, trailers.
    fn read_chunked(&mut self) -> Result<Vec<u8>, Failure> {
        let during = "reading a chunked answer";
        let mut body = Vec::new();
        loop {
            let line = self.read_line(during)?;
            let size_text = line.split(';').next().unwrap_or("").trim();
            let size = usize::from_str_radix(size_text, 16).map_err(|_| {
                Failure::Permanent(format!(
                    "invalid chunk size '{}' in the answer",
                    snippet(line.as_bytes())
                ))
            })?;
            if size == 0 {
                // Trailers up to the empty line; a server closing right away is fine too.
                while !self.read_line(during).unwrap_or_default().is_empty() {}
                return Ok(body);
            }
            if body.len() + size > MAX_RESPONSE_BYTES {
                return Err(Failure::Permanent(format!(
                    "the answer is more than the {MAX_RESPONSE_BYTES} bytes accepted"
                )));
            }
            body.extend(self.read_exact(size)?);
            self.read_line(during)?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_into_host_port_and_path() {
        let e = Endpoint::parse("http://127.0.0.1:8000/score").unwrap();
        assert_eq!((e.host.as_str(), e.port, e.path.as_str()), ("127.0.0.1", 8000, "/score"));
        assert_eq!(e.host_header, "127.0.0.1:8000");
        let e = Endpoint::parse("HTTP://rm.internal").unwrap();
        assert_eq!((e.host.as_str(), e.port, e.path.as_str()), ("rm.internal", 80, "/"));
        assert_eq!(e.host_header, "rm.internal");
        let e = Endpoint::parse("http://[::1]:9/a/b?x=1#frag").unwrap();
        assert_eq!((e.host.as_str(), e.port, e.path.as_str()), ("::1", 9, "/a/b?x=1"));
        assert_eq!(e.host_header, "[::1]:9");
        assert_eq!(Endpoint::parse("http://h?q").unwrap().path, "/?q");
    }

    #[test]
    fn bad_urls_say_what_is_wrong() {
        let err = Endpoint::parse("https://rm.example.com/score").unwrap_err();
        assert!(
            err.contains("https") && err.contains("plain-HTTP") && err.contains("proxy"),
            "{err}"
        );
        assert!(Endpoint::parse("rm:8000/score").unwrap_err().contains("not a URL"));
        assert!(Endpoint::parse("ftp://h/x").unwrap_err().contains("only http://"));
        assert!(Endpoint::parse("http://h:99999/").unwrap_err().contains("port"));
        assert!(Endpoint::parse("http://h:/").unwrap_err().contains("port"));
        assert!(Endpoint::parse("http:///x").unwrap_err().contains("no host"));
        assert!(Endpoint::parse("http://u:p@h/").unwrap_err().contains("credentials"));
        assert!(Endpoint::parse("http://[::1/").unwrap_err().contains("IPv6"));
    }

    #[test]
    fn snippets_are_short_and_on_one_line() {
        assert_eq!(snippet(b"  oops\nbad\r\n"), "oops bad");
        assert_eq!(snippet(&[b'x'; 300]).chars().count(), 201);
    }
}
