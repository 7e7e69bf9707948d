"""The pages people look at, opened in a real headless Chromium (Debian's `chromium` package): the built
docs site, the API docs page, the admin's landing page (the operator's console) and every changelist after a
seeded run, the batch list and a batch's page with its progress bar, and the health page, at a laptop's
1280×800. A console error, a failed request, a missing element or a horizontal scroll bar fails the test; a
screenshot of each page is kept (in pytest's temporary directory, whose path the run prints, and in
RELAY_SCREENSHOT_DIR when it is set).

Chromium is started here with the flags below and a fresh profile, and driven over its DevTools
protocol by Playwright's Python package (`connect_over_cdp`: Playwright downloads no browser). Without
Chromium the test skips, saying so — except under CI=true, where it must run (scripts/browser.sh
installs it)."""

import base64
import functools
import http.server
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from tests.test_docs import build_docs

pytestmark = pytest.mark.django_db(transaction=True)

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
START_TIMEOUT_S = 30
PAGE_TIMEOUT_MS = 15_000
STAFF_PASSWORD = "browser-test-password"


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    reason = "Chromium is not installed (Debian: `bash scripts/browser.sh` or `apt-get install chromium`)"
    if _in_ci():
        pytest.fail(f"{reason}, and CI=true: the browser test must run in CI")
    pytest.skip(f"{reason}; CI=true makes this a failure")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Chromium with a fresh profile, connected over the DevTools protocol."""
    executable = _chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        if _in_ci():
            raise
        pytest.skip("the playwright package is not installed (requirements-dev.txt)")
    profile = tmp_path_factory.mktemp("chromium-profile")
    log = open(profile.parent / "chromium.log", "wb")  # closed below
    proc = subprocess.Popen(
        [executable, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: its helpers are stopped with it
    )
    # Playwright's sync API keeps an asyncio loop running on this thread while it is open, and Django's
    # async-safety guard would refuse the tests' ORM calls (plain synchronous calls, on this thread) for
    # it: the guard stands aside for as long as the browser is connected, and no longer.
    unsafe = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        port = _devtools_port(profile, proc)
        with sync_playwright() as pw:
            chromium = pw.chromium.connect_over_cdp(f"http://127.0.0.1:{port}")
            try:
                yield chromium
            finally:
                chromium.close()
    finally:
        if unsafe is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = unsafe
        _stop(proc)
        log.close()


def _devtools_port(profile: Path, proc: subprocess.Popen) -> int:
    """Chromium writes the port it chose (--remote-debugging-port=0) to DevToolsActivePort in its profile."""
    active = profile / "DevToolsActivePort"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chromium exited with {proc.returncode}; see {profile.parent / 'chromium.log'}")
        if active.exists():
            first = active.read_text().splitlines()[:1]
            if first and first[0].isdigit():
                return int(first[0])
        time.sleep(0.05)
    raise RuntimeError(f"chromium did not open its DevTools port within {START_TIMEOUT_S}s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def shots(tmp_path_factory, pytestconfig):
    """Where screenshots go: pytest's temporary directory (its path printed), and RELAY_SCREENSHOT_DIR when set."""
    tmp = tmp_path_factory.mktemp("screenshots")
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"browser screenshots: {tmp}")
    extra = os.environ.get("RELAY_SCREENSHOT_DIR")
    dirs = [tmp]
    if extra:
        Path(extra).mkdir(parents=True, exist_ok=True)
        dirs.append(Path(extra))
    return dirs


@pytest.fixture(scope="module")
def docs_site(tmp_path_factory):
    """The docs site, built with --strict, served over HTTP on loopback (its search needs fetch, not file://)."""
    site = tmp_path_factory.mktemp("docs") / "site"
    result = build_docs(site)
    assert result.returncode == 0, result.stdout + result.stderr
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


# A laptop's window: every admin page must fit it without a horizontal scroll bar.
VIEWPORT = {"width": 1280, "height": 800}


class Tab:
    """The one tab the module opens its pages in (a tab or a context per page or per test costs Chromium
    0.1-0.5 s each), and what its pages did: console and page errors, failed requests and HTTP error answers,
    the requests made since the last page was opened and those still in flight."""

    def __init__(self, context):
        self.context = context
        self.page = context.new_page()
        self.cdp = context.new_cdp_session(self.page)
        self.problems: list[str] = []
        self.requested: set[str] = set()
        self.pending: set = set()
        page = self.page
        page.on("console", self._console)
        page.on("pageerror", lambda exc: self.problems.append(f"page error: {exc}"))
        page.on("request", self._request)
        page.on("requestfinished", lambda request: self.pending.discard(request))
        page.on("requestfailed", self._failed)
        page.on("response", self._response)

    def _console(self, message):
        if message.type == "error" and not _browser_own(message.location.get("url", "")):
            self.problems.append(f"console error: {message.text} ({message.location.get('url')})")

    def _request(self, request):
        self.requested.add(request.url)
        self.pending.add(request)

    def _failed(self, request):
        self.pending.discard(request)
        # The browser's own /favicon.ico, still in flight when the tab moves on to the next page, is cancelled.
        if not _browser_own(request.url):
            self.problems.append(f"request failed: {request.url} ({request.failure})")

    def _response(self, response):
        if response.status >= 400 and not _browser_own(response.url):
            self.problems.append(f"HTTP {response.status}: {response.url}")

    def settle(self, url: str) -> None:
        """Until the page's icon (which the browser asks for only after `load`), when it names one, is asked
        for, and every request the page has made is answered. Playwright hands over events while it waits."""
        icons = set(self.page.evaluate("() => [...document.querySelectorAll('link[rel~=icon]')].map(l => l.href)"))
        deadline = time.monotonic() + PAGE_TIMEOUT_MS / 1000
        while self.pending or (icons and not icons & self.requested):
            assert time.monotonic() < deadline, f"{url}: still loading {[r.url for r in self.pending] or icons}"
            self.page.wait_for_timeout(10)

    def screenshot(self) -> bytes:
        """The whole page, as PNG: the capture Playwright's full-page screenshot makes, but with Chromium's
        fast PNG encoding (`optimizeForSpeed`), which Playwright does not offer; its default one, compressing
        for size, takes Chromium about twice as long on the long pages (the docs', the API docs')."""
        size = self.cdp.send("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        shot = self.cdp.send(
            "Page.captureScreenshot",
            {"format": "png", "optimizeForSpeed": True, "captureBeyondViewport": True, "clip": clip},
        )
        return base64.b64decode(shot["data"])


@pytest.fixture(scope="module")
def module_tab(browser):
    ctx = browser.new_context(viewport=VIEWPORT)
    yield Tab(ctx)
    ctx.close()


@pytest.fixture
def tab(module_tab):
    """The module's tab, logged out (each test logs in afresh), with nothing carried over to check."""
    module_tab.context.clear_cookies()
    module_tab.problems.clear()
    return module_tab


def visit(tab: Tab, url: str, name: str, shots, expect: dict[str, str | None], *, idle=False, fits=False):
    """Open url in the tab; fail on a console error, a page error, a failed request or an HTTP error answer,
    and on any selector of `expect` that is not visible (or whose text lacks the given text); with `fits`, on
    a horizontal scroll bar (the page's, or a list's own). Saves a full-page screenshot named `name`.png.
    Returns the page, still open.

    The page is taken as loaded at its `load` event, once every selector of `expect` is visible, the icon
    it names (if any) has been asked for and every request made so far is answered. The admin's pages make
    no other request after `load`: no script of theirs fetches anything, and they name no icon (the
    browser's own /favicon.ico is not the page's). The API docs page's late requests are its schema, which
    is answered before its operations (in `expect`) are drawn, and its icon. `idle` waits instead for
    Playwright's `networkidle` (no request for 500 ms): the docs site's theme starts a web worker that
    fetches the search index, at a moment of its own."""
    page = tab.page
    # What the tab did since its last page was checked (a login's landing, a search) counts too.
    assert not tab.problems, f"before {url}: {tab.problems}"
    tab.requested.clear()
    response = page.goto(url, wait_until="networkidle" if idle else "load", timeout=PAGE_TIMEOUT_MS)
    assert response is not None and response.ok, f"{url}: {response and response.status}"
    missing = []
    for selector, text in expect.items():
        node = page.locator(selector).first
        try:
            node.wait_for(state="visible", timeout=PAGE_TIMEOUT_MS)
        except Exception:
            missing.append(selector)
            continue
        if text is not None and text not in node.inner_text():
            missing.append(f"{selector} with text {text!r} (got {node.inner_text()[:200]!r})")
    tab.settle(url)
    png = tab.screenshot()  # taken once, kept in every directory
    for directory in shots:
        (directory / f"{name}.png").write_bytes(png)
    assert not missing, f"{url}: missing {missing}"
    assert not tab.problems, f"{url}: {tab.problems}"
    if fits:
        wide = page.evaluate(_SCROLLS_SIDEWAYS)
        assert not wide, f"{url}: scrolls sideways at {VIEWPORT['width']} px: {wide}"
    return page


# The page, and any box that scrolls on its own (Django's changelist wraps its table in `.results`, which
# scrolls instead of the page), wider than its window: what a horizontal scroll bar hides.
_SCROLLS_SIDEWAYS = """() => {
  const out = [];
  const doc = document.documentElement;
  if (doc.scrollWidth > doc.clientWidth + 1) out.push(`page ${doc.scrollWidth} > ${doc.clientWidth}`);
  for (const el of document.querySelectorAll('body *')) {
    const style = getComputedStyle(el);
    if (['auto', 'scroll'].includes(style.overflowX) && el.scrollWidth > el.clientWidth + 1) {
      const name = `${el.tagName.toLowerCase()}${el.id ? '#' + el.id : ''}.${el.className}`;
      out.push(`${name} ${el.scrollWidth} > ${el.clientWidth}`);
    }
  }
  return out;
}"""


def _browser_own(url: str) -> bool:
    """A request the browser makes by itself, not one the page asks for: `/favicon.ico` on pages that name
    no icon (the admin's). Its 404 is not the page's error."""
    return url.split("?", 1)[0].endswith("/favicon.ico")


@pytest.fixture(scope="module")
def staff_password_hash():
    """Hashed once: Django's hasher takes ~0.4 s of CPU a time, by design. Logging in still checks it."""
    from django.contrib.auth.hashers import make_password

    return make_password(STAFF_PASSWORD)


@pytest.fixture
def staff(django_user_model, staff_password_hash):
    user = django_user_model.objects.create_superuser("browser-admin", "admin@example.com", None)
    user.password = staff_password_hash
    user.save(update_fields=["password"])
    return user


@pytest.fixture
def logged_in(tab, live_server, staff, shots):
    """Log in through the admin's own login form, as an operator would."""
    page = visit(
        tab,
        f"{live_server.url}/admin/login/",
        "admin-login",
        shots,
        {"#id_username": None, "#id_password": None},
    )
    page.fill("#id_username", staff.username)
    page.fill("#id_password", STAFF_PASSWORD)
    with page.expect_navigation():
        page.click("input[type=submit]")
    assert page.url.rstrip("/").endswith("/admin"), page.url
    return tab


@pytest.fixture
def batch(live_server, catalog):
    """A native batch submitted over HTTP, with items in three states, so its progress bar has segments."""
    import requests
    from django.utils import timezone

    from batches.models import Item

    body = {
        "shape": "openai",
        "requests": [{"model": "gpt-4o", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(6)],
    }
    resp = requests.post(
        f"{live_server.url}/v1/batches",
        data=json.dumps(body),
        headers={"Authorization": f"Bearer {catalog.key}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert resp.status_code == 202, resp.text
    batch_id = resp.json()["id"]
    # No worker runs in this module: put items where a worker would have, so the bar has several colours.
    now = timezone.now()
    items = Item.objects.filter(batch_id=batch_id)
    items.filter(idx__in=[0, 1, 2]).update(state="completed", finished_at=now)
    items.filter(idx=3).update(state="discarded", finished_at=now, error="batch: upstream answered 500")
    items.filter(idx=4).update(state="running", lease_owner="browser-test", lease_expires_at=now + timedelta(minutes=5))
    return batch_id


def test_docs_site(tab, docs_site, shots):
    visit(
        tab,
        f"{docs_site}/",
        "docs-index",
        shots,
        {".md-header": None, "nav.md-nav": None, "article h1": "Relay batch", "article table": None},
        idle=True,
    )
    page = visit(
        tab,
        f"{docs_site}/architecture/",
        "docs-architecture",
        shots,
        {"article h1": "Architecture", "article pre code": "PostgreSQL", "article h2#why-nothing-is-lost": None},
        idle=True,
    )
    # The site's search (a web worker over search_index.json) answers offline.
    page.click("input.md-search__input")
    page.locator("input.md-search__input").press_sequentially("lease", delay=30)
    page.locator(".md-search-result__item").first.wait_for(state="visible", timeout=PAGE_TIMEOUT_MS)
    visit(
        tab,
        f"{docs_site}/configuration/",
        "docs-configuration",
        shots,
        {"article table:has-text('DATABASE_URL')": None},
        idle=True,
    )


def test_api_docs_page(tab, live_server, shots):
    visit(
        tab,
        f"{live_server.url}/api/docs/",
        "api-docs",
        shots,
        {".swagger-ui .info .title": "Relay batch API", ".swagger-ui .opblock": None},
    )


def test_admin_batch_list_batch_page_and_health_page(logged_in, live_server, batch, shots):
    # One test for the three pages: a login and a batch (~1-2 s of set-up) serve them all.
    short = batch[:8]
    visit(
        logged_in,
        f"{live_server.url}/admin/batches/batch/",
        "admin-batch-list",
        shots,
        {"#result_list": None, "#result_list .relay-progress": None, f"#result_list a:has-text('{short}')": None},
    )
    page = visit(
        logged_in,
        f"{live_server.url}/admin/batches/batch/{batch}/change/",
        "admin-batch-page",
        shots,
        {"#content h1": None, ".relay-progress": None, "#content": "browse all 6 items"},
    )
    segments = page.locator(".relay-progress span")
    widths = [segments.nth(i).evaluate("el => el.getBoundingClientRect().width") for i in range(segments.count())]
    # completed, discarded, cancelled, running, available: 3, 1, 0, 1, 1 of 6 items
    assert len(widths) == 5 and widths[2] == 0 and all(widths[i] > 0 for i in (0, 1, 3, 4)), widths

    visit(
        logged_in,
        f"{live_server.url}/admin/health/",
        "admin-health",
        shots,
        {
            "#content h1": "Health",
            "#content-main h2:has-text('Queues')": None,
            "#content-main h2:has-text('Batch items')": None,
            "#content-main h2:has-text('Workers seen by Celery')": None,
            "#content-main h2:has-text('Circuit breakers')": None,
            "#content-main td:has-text('completed')": None,
            "#content-main td:has-text('openai-0')": None,
        },
    )


@pytest.fixture
def seeded_run(live_server, catalog):
    """A few batches on every surface, a provider job, spend over days, a budget near its limit, an open
    breaker, a failing webhook endpoint and failures in the last hour (tests/test_admin_console.py)."""
    from tests.test_admin_console import seed_console

    return seed_console(catalog)


def test_admin_landing_page_and_every_list_fit_a_laptop(seeded_run, logged_in, live_server, shots):
    # seeded_run first: logging in opens the landing page, whose spend is then kept for a minute.
    from django.contrib import admin

    visit(
        logged_in,
        f"{live_server.url}/admin/",
        "admin-landing",
        shots,
        {
            "#panel-now #in-flight": None,
            "#panel-now #breakers": "openai-1",
            "#panel-now #endpoints": "billing-hook",
            "#panel-money svg.relay-chart": None,
            "#panel-money #budgets": "proj-a-monthly",
            "#panel-money #saved": "saved by provider batch mode",
            "#panel-trouble #host-errors": "openai",
            "#content-main .app-batches": None,
        },
        fits=True,
    )
    visit(
        logged_in,
        f"{live_server.url}/admin/?by=model",
        "admin-landing-by-model",
        shots,
        {"svg.relay-chart": None},
        fits=True,
    )
    for model in admin.site._registry:
        opts = model._meta
        visit(
            logged_in,
            f"{live_server.url}/admin/{opts.app_label}/{opts.model_name}/",
            f"admin-list-{opts.app_label}-{opts.model_name}",
            shots,
            {"#changelist": None},
            fits=True,
        )
