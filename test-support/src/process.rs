//! An example's server binary run by a test: started, its address read from its first line
//! (`listening on ...`), signalled, waited for with a bound, and killed when dropped.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A server process started by a test; killed (and reaped) when dropped.
#[derive(Debug)]
pub struct ServerProcess {
    child: Child,
    /// What follows `listening on ` on its first line: `http://127.0.0.1:PORT` or
    /// `127.0.0.1:PORT`, as the binary prints it.
    pub listening: String,
}

impl ServerProcess {
    /// Runs `cmd` (its stdout is taken) and waits for its first line, `listening on ADDR`.
    pub fn start(mut cmd: Command) -> ServerProcess {
        let program = cmd.get_program().to_string_lossy().into_owned();
        let mut child = cmd
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("{program} starts: {e}"));
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout is piped"))
            .read_line(&mut line)
            .unwrap_or_else(|e| panic!("{program}'s first line: {e}"));
        let listening = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("{program}: unexpected first line {line:?}"))
            .to_owned();
        ServerProcess { child, listening }
    }

    /// Its address as an `http://` URL.
    pub fn url(&self) -> String {
        if self.listening.starts_with("http://") {
            self.listening.clone()
        } else {
            format!("http://{}", self.listening)
        }
    }

    /// Its address, `HOST:PORT`.
    pub fn addr(&self) -> &str {
        self.listening.trim_start_matches("http://")
    }

    /// Sends it `signal` (`-TERM`, `-STOP`, ...).
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success(), "kill {signal}");
    }

    /// Waits, at most `limit`, for it to end by itself; how it ended.
    pub fn wait_for_exit(&mut self, limit: Duration) -> ExitStatus {
        let give_up = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(
                Instant::now() < give_up,
                "the server still runs {limit:?} later"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
