//! A small W3C WebDriver client (https://www.w3.org/TR/webdriver2/) over reqwest, driving
//! Debian's headless Chromium through chromedriver on loopback.
//!
//! Written here rather than pulling fantoccini/thirtyfour: those bring their own hyper
//! client and TLS stack (CRATES.md: one TLS provider), and the admin page's test needs only
//! a dozen endpoints: session, navigate, find, click, type, text, source, execute,
//! screenshot.

use base64::Engine;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The element reference key of the W3C protocol.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// Where Debian installs the browser and its driver (packages chromium, chromium-driver).
pub const CHROMIUM: &str = "/usr/bin/chromium";
pub const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// A chromedriver process and one browser session; both end when dropped.
pub struct Browser {
    driver: Child,
    base: String,
    session: String,
    http: reqwest::Client,
    shots: PathBuf,
    profile: tempfile::TempDir,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Browser {
    /// Starts chromedriver and a headless Chromium session; screenshots go to `shots`.
    ///
    /// # Panics
    /// When Chromium or chromedriver is missing (`scripts/test.sh` installs them) or does
    /// not start within 30 s.
    pub async fn start(shots: &Path) -> Browser {
        for bin in [CHROMIUM, CHROMEDRIVER] {
            assert!(
                Path::new(bin).exists(),
                "{bin} is missing: install Debian's chromium and chromium-driver (scripts/test.sh does)"
            );
        }
        std::fs::create_dir_all(shots).unwrap();
        let port = free_port();
        let driver = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let base = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
        let start = Instant::now();
        loop {
            if let Ok(r) = http.get(format!("{base}/status")).send().await
                && let Ok(v) = r.json::<Value>().await
                && v["value"]["ready"] == true
            {
                break;
            }
            assert!(start.elapsed() < Duration::from_secs(30), "chromedriver did not become ready");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let profile = tempfile::Builder::new().prefix("idem-chromium-profile-").tempdir().unwrap();
        let profile_arg = format!("--user-data-dir={}", profile.path().display());
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": CHROMIUM,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--window-size=1280,1000", "--no-first-run", "--disable-extensions", profile_arg]
            }
        }}});
        let r: Value = http.post(format!("{base}/session")).json(&caps).send().await.unwrap().json().await.unwrap();
        let session = r["value"]["sessionId"].as_str().unwrap_or_else(|| panic!("no session: {r}")).to_string();
        Browser { driver, base, session, http, shots: shots.to_path_buf(), profile }
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let url = format!("{}/session/{}{path}", self.base, self.session);
        let mut req = self.http.request(method, url);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let v: Value = req.send().await.unwrap().json().await.unwrap();
        if let Some(err) = v["value"]["error"].as_str() {
            panic!("WebDriver {path}: {err}: {}", v["value"]["message"]);
        }
        v["value"].clone()
    }

    /// Resizes the window to `width` × `height` CSS pixels (1280 × 1000 at start).
    pub async fn set_window_size(&self, width: u32, height: u32) {
        self.call(reqwest::Method::POST, "/window/rect", Some(json!({"width": width, "height": height}))).await;
    }

    /// Navigates to `url` and waits for the page to load.
    pub async fn goto(&self, url: &str) {
        self.call(reqwest::Method::POST, "/url", Some(json!({"url": url}))).await;
    }

    /// The current page's URL.
    pub async fn url(&self) -> String {
        self.call(reqwest::Method::GET, "/url", None).await.as_str().unwrap().to_string()
    }

    /// The current page's HTML.
    pub async fn source(&self) -> String {
        self.call(reqwest::Method::GET, "/source", None).await.as_str().unwrap().to_string()
    }

    /// The element matching the CSS selector, if any.
    pub async fn try_find(&self, css: &str) -> Option<String> {
        let url = format!("{}/session/{}/element", self.base, self.session);
        let v: Value = self
            .http
            .post(url)
            .json(&json!({"using": "css selector", "value": css}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if std::env::var_os("IDEM_WEBDRIVER_DEBUG").is_some() {
            eprintln!("find {css}: {v}");
        }
        v["value"][ELEMENT].as_str().map(str::to_owned)
    }

    /// The element matching the CSS selector.
    ///
    /// # Panics
    /// When there is none.
    pub async fn find(&self, css: &str) -> String {
        match self.try_find(css).await {
            Some(e) => e,
            None => panic!("no element {css} on {}:\n{}", self.url().await, self.source().await),
        }
    }

    /// Clicks the element matching `css`.
    pub async fn click(&self, css: &str) {
        let e = self.find(css).await;
        self.call(reqwest::Method::POST, &format!("/element/{e}/click"), Some(json!({}))).await;
    }

    /// Clicks the element matching `css` and waits (at most 10 s) until the page it leads
    /// to has loaded: a click returns before a form submission or link navigates.
    pub async fn click_and_wait(&self, css: &str) {
        self.execute("window.__idemOldPage = true; return null;").await;
        self.click(css).await;
        self.wait_for_new_page().await;
    }

    /// Waits (at most 10 s) until the page marked by `click_and_wait` (or a script that sets
    /// `window.__idemOldPage`) was replaced by a fully loaded one.
    pub async fn wait_for_new_page(&self) {
        let start = Instant::now();
        loop {
            let v =
                self.execute("return window.__idemOldPage === undefined && document.readyState === 'complete';").await;
            if v == true {
                return;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "no new page after 10 s at {}", self.url().await);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Types `text` into the element matching `css`.
    pub async fn type_into(&self, css: &str, text: &str) {
        let e = self.find(css).await;
        self.call(reqwest::Method::POST, &format!("/element/{e}/value"), Some(json!({"text": text}))).await;
    }

    /// The visible text of the element matching `css`.
    pub async fn text(&self, css: &str) -> String {
        let e = self.find(css).await;
        self.call(reqwest::Method::GET, &format!("/element/{e}/text"), None).await.as_str().unwrap().to_string()
    }

    /// Runs `script` in the page (synchronously) and returns its value.
    pub async fn execute(&self, script: &str) -> Value {
        self.call(reqwest::Method::POST, "/execute/sync", Some(json!({"script": script, "args": []}))).await
    }

    /// Saves a PNG of the viewport as `<shots>/<name>.png`; returns its path.
    pub async fn screenshot(&self, name: &str) -> PathBuf {
        let b64 = self.call(reqwest::Method::GET, "/screenshot", None).await;
        let png = base64::engine::general_purpose::STANDARD.decode(b64.as_str().unwrap()).unwrap();
        assert!(png.starts_with(b"\x89PNG"), "a PNG screenshot");
        let path = self.shots.join(format!("{name}.png"));
        std::fs::write(&path, png).unwrap();
        path
    }
}

impl Browser {
    /// Ends the browser session (then the driver, on drop).
    pub async fn quit(self) {
        let url = format!("{}/session/{}", self.base, self.session);
        let _ = self.http.delete(url).send().await;
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        // A browser left behind by a test that panicked before `quit`: matched by its own
        // profile directory, which no other process names. (Never signal a process group
        // by a negative pid through kill(1): procps reads `-PID` as an option.)
        let _ = Command::new("pkill").arg("-KILL").arg("-f").arg(self.profile.path()).status();
    }
}
