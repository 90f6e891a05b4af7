package test

import (
	"context"
	"encoding/json"
	"fmt"
	"html"
	"math"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/emulation"
	cdplog "github.com/chromedp/cdproto/log"
	"github.com/chromedp/cdproto/runtime"
	"github.com/chromedp/chromedp"
	"github.com/hibiken/asynq"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// updateImages, when set (SLUICE_UPDATE_DOCS_IMAGES=1), makes
// TestLimitsPageAndDashboard write the screenshots docs/ shows: the limits
// page and the dashboard's first row.
var updateImages = os.Getenv("SLUICE_UPDATE_DOCS_IMAGES") != ""

// TestLimitsPageAndDashboard: two workers drain 200 tasks through a drain
// of 20/s (leaky bucket, burst 1), a quota that never binds (token bucket
// 1,000/s) and a quota keyed by destination (8/s burst 2 each) on which
// the hot destination (120 tasks) is throttled, while a real Prometheus
// scrapes both every second and evaluates deploy/rules. During the drain
// (its figures read 9 s in, past its start):
//   - the limits page in headless Chromium draws itself and draws again
//     within 4 s, with no console error, exception or failed load; what
//     it shows agrees with enqueue status read before and after it (the drain's
//     pending and waiting tasks within what 20/s moves in the time between
//     the reads plus its 1.5 s refresh, the quotas' levels within that
//     too, the busiest key of the keyed quota the same: hot) and with
//     Prometheus (its worker's admitted per second through the drain
//     within 25% or 2/s of Prometheus's rate of the same counter over the
//     same span, the page's, 5 s or more);
//   - with JavaScript off the page is the table, every gate a row (a
//     queue's fair share and concurrency limit too);
//   - every query of every panel of deploy/grafana's dashboard returns
//     data, and Prometheus evaluated every rule of deploy/rules without
//     error over series that exist.
//
// After it, promtool accepts the names and help texts of every metric the
// worker serves.
func TestLimitsPageAndDashboard(t *testing.T) {
	t.Parallel()
	queue, api, dest := redistest.Queue(t, "page"), redistest.Queue(t, "api"), redistest.Queue(t, "dest")
	fair := redistest.Queue(t, "fair") // no tasks: its gates' rows only
	r := startFleet(t, backends[0], 2, fmt.Sprintf(`
worker: {concurrency: 10}
queues:
  %s: {drain: {algorithm: leaky_bucket, limit: 20, period: 1s, burst: 1}}
  %s: {concurrency: 3, drain: {limit: 5, period: 1s}, fairness: {key: 'payload.headers["X-Tenant"]'}}
quotas:
  %s: {algorithm: token_bucket, limit: 1000, period: 1s, burst: 1000}
  %s: {algorithm: token_bucket, limit: 8, period: 1s, burst: 2, key: 'payload.headers["X-Dest"]'}
tasks:
  http:request: {quotas: [%s, %s]}
`, queue, fair, api, dest, api, dest))
	prom := startPrometheus(t, []string{r.fleet[0].metrics, r.fleet[1].metrics})

	// 3 hot tasks to every 2 cold ones, each cold destination with 2.
	r.pause(t, queue)
	client := asynq.NewClient(r.asynqOpt(t))
	for i := range 40 {
		enqueueWithHeaders(t, client, r.u.URL, queue, fmt.Sprint("hot-", i), 3, map[string]string{"X-Dest": "hot"})
		enqueueWithHeaders(t, client, r.u.URL, queue, fmt.Sprint("cold-", i), 2, map[string]string{"X-Dest": fmt.Sprint("cold-", i)})
	}
	client.Close()
	// Prometheus's first scrape comes seconds after it starts (its target
	// discovery sends updates every 5 s): the drain starts once it has.
	testkit.WaitFor(t, 30*time.Second, "prometheus scraping both workers", func() bool {
		up, err := prom.query(t, `up{job="sluice-worker"} == 1`, time.Time{})
		return err == nil && len(up) == 2
	})
	start := r.letGo(t, queue)

	page := "http://" + r.fleet[0].metrics + "/ui/limits"
	browser := newBrowser(t)
	tab, problems := browser.open(t, page, true)
	// Two redraws: the page refreshes itself.
	var first, drawn pageView
	testkit.WaitFor(t, 20*time.Second, "the page drawn by its script", func() bool {
		first = tab.read(t)
		return first.DrawnBy == "script"
	})
	testkit.WaitFor(t, 4*time.Second, "the page redrawn", func() bool {
		drawn = tab.read(t)
		return drawn.Time != first.Time
	})

	// The page's figures against enqueue status and Prometheus, once the
	// page has 5 s of this worker's counters.
	gate := "drain:" + queue
	testkit.WaitFor(t, 20*time.Second, "the page's rates", func() bool {
		return tab.read(t).Rows[gate]["admitted"] != "-"
	})
	// Its first seconds are the drain's start (the backlog booked, this
	// worker's share of the drain still settling): the figures are read
	// from a window after it, while the hot destination still drains.
	time.Sleep(time.Until(start.Add(9 * time.Second)))
	before := time.Now()
	statusBefore := r.status(t)
	shown := tab.read(t)
	statusAfter := r.status(t)
	spread := time.Since(before) + 1500*time.Millisecond // the reads' span and the page's refresh
	moved := 20*spread.Seconds() + 2
	drainRow := shown.Rows[gate]
	backlog := func(s statusDoc) int {
		q := s.queue(t, queue)
		return q.Pending + q.Waiting
	}
	onPage := cellInt(t, drainRow, "pending") + cellInt(t, drainRow, "waiting")
	low, high := min(backlog(statusBefore), backlog(statusAfter)), max(backlog(statusBefore), backlog(statusAfter))
	t.Logf("drain %s: page %d pending and waiting, status %d then %d (%v apart, with the refresh)", queue, onPage, backlog(statusBefore), backlog(statusAfter), spread.Round(time.Millisecond))
	if float64(onPage) < float64(low)-moved || float64(onPage) > float64(high)+moved {
		t.Errorf("the page shows %d tasks pending and waiting in %s; enqueue status %d and %d: want within %.0f", onPage, queue, backlog(statusBefore), backlog(statusAfter), moved)
	}
	for _, q := range []struct {
		gate  string
		level func(statusDoc) int
	}{
		{gate, func(s statusDoc) int { return s.queue(t, queue).Drain.Level }},
		{"quota:" + api, func(s statusDoc) int { return s.quota(t, api).Level }},
	} {
		level, capacity := cellLevel(t, shown.Rows[q.gate])
		lo, hi := min(q.level(statusBefore), q.level(statusAfter)), max(q.level(statusBefore), q.level(statusAfter))
		t.Logf("%s: page level %d of %d, status %d then %d", q.gate, level, capacity, q.level(statusBefore), q.level(statusAfter))
		if float64(level) < float64(lo)-moved || float64(level) > float64(hi)+moved || level > capacity {
			t.Errorf("%s: the page shows level %d of %d; enqueue status %d and %d: want within %.0f", q.gate, level, capacity, q.level(statusBefore), q.level(statusAfter), moved)
		}
	}
	busiest := r.busiestKey(t, "quota:"+dest)
	if got := shown.Rows["quota:"+dest]["key0"]; got != "hot" || busiest != "hot" {
		t.Errorf("busiest key of quota:%s: page %q, status --keys %q, want hot in both", dest, got, busiest)
	}
	pageAt, err := time.Parse(time.RFC3339Nano, shown.Time)
	if err != nil {
		t.Fatalf("the page's time %q: %v", shown.Time, err)
	}
	admitted := cellFloat(t, drainRow, "admitted")
	window, err := strconv.ParseFloat(shown.Window, 64)
	if err != nil || window < 5 {
		t.Fatalf("the page's rates are over %q s, want 5 s or more", shown.Window)
	}
	res, err := prom.query(t, fmt.Sprintf(`rate(sluice_gate_admitted_tasks_total{gate=%q,instance=%q}[%dms])`, gate, r.fleet[0].metrics, int(window*1000)), pageAt)
	if err != nil || len(res) != 1 {
		t.Fatalf("prometheus: admitted rate of the page's worker: %v %v", res, err)
	}
	t.Logf("%s on %s: page %.1f admitted/s, prometheus %.2f/s, over the %.1f s to %.1f s after the drain began", gate, r.fleet[0].metrics, admitted, res[0].value(), pageAt.Sub(start).Seconds()-window, pageAt.Sub(start).Seconds())
	if want := res[0].value(); math.Abs(admitted-want) > max(2, 0.25*want) {
		t.Errorf("the page shows %.1f admitted/s through %s; prometheus's rate of the same counter %.2f/s: want within 25%% or 2/s", admitted, gate, want)
	}

	// Without JavaScript: the server's table, every gate a row.
	plain, _ := browser.open(t, page, false)
	static := plain.read(t)
	for _, g := range []string{gate, "quota:" + api, "quota:" + dest, "drain:" + fair, "fair:" + fair, "concurrency:queue:" + fair} {
		if row, ok := static.Rows[g]; !ok || row["limit"] == "" || row["level"] == "" {
			t.Errorf("the page without JavaScript has no row for %s with its limit and level: %v", g, static.Rows)
		}
	}
	if static.DrawnBy != "" {
		t.Errorf("the page without JavaScript was drawn by %q", static.DrawnBy)
	}
	screenshot := tab.screenshot(t)

	// The dashboard's panels and the rules, once Prometheus has enough of
	// the drain.
	var empty, notYet []string
	testkit.WaitFor(t, 30*time.Second, "every panel with data and every rule evaluated over existing series", func() bool {
		empty, notYet = checkPanels(t, prom), checkRules(t, prom)
		return len(empty) == 0 && len(notYet) == 0
	})
	if t.Failed() {
		t.Logf("empty panels: %v; rules: %v", empty, notYet)
	}
	if problems := problems(); len(problems) > 0 {
		t.Errorf("the limits page's console: %s", strings.Join(problems, "; "))
	}
	r.finish(t, 200, 60*time.Second, queue)
	checkMetricsLint(t, r.fleet[0].metrics)

	// The dashboard's first row over the whole drain, drawn from its
	// panels' data.
	time.Sleep(2 * time.Second) // the drain's last scrapes
	rowShot := browser.screenshotHTML(t, renderFirstRow(t, prom, start.Add(-5*time.Second)))
	if updateImages {
		for name, png := range map[string][]byte{"limits-page.png": screenshot, "dashboard-first-row.png": rowShot} {
			if err := os.WriteFile(filepath.Join("..", "docs", "images", name), png, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// checkMetricsLint: promtool accepts the names and help texts of every
// metric the worker at addr serves.
func checkMetricsLint(t *testing.T, addr string) {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	check := exec.Command("promtool", "check", "metrics")
	check.Stdin = resp.Body
	if out, err := check.CombinedOutput(); err != nil {
		t.Errorf("promtool check metrics on %s: %v\n%s", addr, err, out)
	}
}

// status is `enqueue status --json` on the run's config.
func (r *fleetRun) status(t *testing.T) statusDoc {
	t.Helper()
	var doc statusDoc
	r.runJSON(t, &doc, "status", "--json")
	return doc
}

// busiestKey is the first key `enqueue status --keys gate` lists.
func (r *fleetRun) busiestKey(t *testing.T, gate string) string {
	t.Helper()
	var doc keysDoc
	r.runJSON(t, &doc, "status", "--keys", gate, "--json")
	if len(doc.Keys) == 0 {
		return ""
	}
	return doc.Keys[0].Key
}

func (d statusDoc) quota(t *testing.T, name string) statusGate {
	t.Helper()
	i := slices.IndexFunc(d.Quotas, func(q statusGate) bool { return q.Name == name })
	if i < 0 {
		t.Fatalf("status does not list quota %s", name)
	}
	return d.Quotas[i]
}

// pageView is what the limits page shows: by gate, its cells by field
// (data-field), and key0 its busiest key.
type pageView struct {
	Time    string
	DrawnBy string
	Window  string // the span of the rates, in seconds
	Rows    map[string]map[string]string
}

// readPage is the script that reads a pageView out of the page's DOM.
const readPage = `JSON.stringify({
  Time: document.body.dataset.time || "",
  DrawnBy: document.body.dataset.drawnBy || "",
  Window: document.body.dataset.rateWindow || "",
  Rows: Object.fromEntries([...document.querySelectorAll("#gates > tbody > tr[data-gate]")].map(tr => {
    const cells = Object.fromEntries([...tr.querySelectorAll(":scope > td[data-field]")].map(td => [td.dataset.field, td.textContent.trim()]));
    const key = tr.querySelector("tr[data-key]");
    cells.key0 = key ? key.dataset.key : "";
    return [tr.dataset.gate, cells];
  })),
})`

func cellInt(t *testing.T, row map[string]string, field string) int {
	t.Helper()
	n, err := strconv.Atoi(row[field])
	if err != nil {
		t.Fatalf("the page's %s %q is not a count: %v", field, row[field], err)
	}
	return n
}

func cellFloat(t *testing.T, row map[string]string, field string) float64 {
	t.Helper()
	f, err := strconv.ParseFloat(row[field], 64)
	if err != nil {
		t.Fatalf("the page's %s %q is not a number: %v", field, row[field], err)
	}
	return f
}

// cellLevel reads a level cell: "LEVEL of CAPACITY".
func cellLevel(t *testing.T, row map[string]string) (level, capacity int) {
	t.Helper()
	if _, err := fmt.Sscanf(row["level"], "%d of %d", &level, &capacity); err != nil {
		t.Fatalf("the page's level %q: %v", row["level"], err)
	}
	return level, capacity
}

// browser is a headless Chromium for the test.
type browser struct{ ctx context.Context }

func newBrowser(t *testing.T) *browser {
	t.Helper()
	path, err := exec.LookPath("chromium-headless-shell")
	if err != nil {
		if path, err = exec.LookPath("chromium"); err != nil {
			t.Fatal("no headless Chromium installed: make test installs chromium-headless-shell (scripts/test-tools.sh)")
		}
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(path), chromedp.NoSandbox, chromedp.WindowSize(1500, 700))
	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(alloc)
	t.Cleanup(func() { cancel(); cancelAlloc() })
	if err := chromedp.Do(ctx); err != nil { // starts the browser
		t.Fatalf("starting %s: %v", path, err)
	}
	return &browser{ctx: ctx}
}

// tab is one page open in the browser.
type tab struct{ ctx context.Context }

// browserWait bounds each step in the browser.
const browserWait = 30 * time.Second

// open opens url in a new tab, with or without JavaScript, and returns it
// with what went wrong on its console so far: console errors, warnings and
// failed asserts, uncaught exceptions, and the browser's own errors and
// warnings (a load that failed).
func (b *browser) open(t *testing.T, url string, script bool) (*tab, func() []string) {
	t.Helper()
	ctx, cancel := chromedp.NewContext(b.ctx)
	t.Cleanup(cancel)
	var mu sync.Mutex
	var problems []string
	err := chromedp.Listen(ctx, func(ev any) {
		mu.Lock()
		defer mu.Unlock()
		switch ev := ev.(type) {
		case *runtime.EventConsoleAPICalled:
			switch ev.Type {
			case runtime.ConsoleAPICalledTypeError, runtime.ConsoleAPICalledTypeWarning, runtime.ConsoleAPICalledTypeAssert:
				args := make([]string, len(ev.Args))
				for i, a := range ev.Args {
					args[i] = string(a.Value)
				}
				problems = append(problems, fmt.Sprintf("console.%s %s", ev.Type, strings.Join(args, " ")))
			}
		case *runtime.EventExceptionThrown:
			problems = append(problems, (&chromedp.ExceptionError{ExceptionDetails: ev.ExceptionDetails}).Error())
		case *cdplog.EventEntryAdded:
			if ev.Entry.Level == cdplog.EntryLevelError || ev.Entry.Level == cdplog.EntryLevelWarning {
				problems = append(problems, fmt.Sprintf("%s %s: %s %s", ev.Entry.Level, ev.Entry.Source, ev.Entry.Text, ev.Entry.URL))
			}
		}
	})
	if err != nil {
		t.Fatalf("opening a tab: %v", err)
	}
	step, cancelStep := context.WithTimeout(ctx, browserWait)
	defer cancelStep()
	for _, cmd := range []cdp.Command[cdp.Empty, cdp.Empty]{cdplog.Enable, runtime.Enable} {
		if _, err := chromedp.Call(step, cmd, cdp.Empty{}); err != nil {
			t.Fatalf("%s: %v", cmd.Method, err)
		}
	}
	if _, err := chromedp.Call(step, emulation.SetScriptExecutionDisabled, emulation.SetScriptExecutionDisabledParams{Value: !script}); err != nil {
		t.Fatalf("turning scripts off: %v", err)
	}
	if err := chromedp.Do(step, chromedp.Navigate(url)); err != nil {
		t.Fatalf("opening %s: %v", url, err)
	}
	return &tab{ctx: ctx}, func() []string {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(problems)
	}
}

// read reads what the page shows now.
func (tb *tab) read(t *testing.T) pageView {
	t.Helper()
	step, cancel := context.WithTimeout(tb.ctx, browserWait)
	defer cancel()
	doc, err := chromedp.Run(step, chromedp.Evaluate[string](readPage))
	if err != nil {
		t.Fatalf("reading the page: %v", err)
	}
	var v pageView
	if err := json.Unmarshal([]byte(doc), &v); err != nil {
		t.Fatalf("reading the page: %v", err)
	}
	return v
}

// screenshot is a PNG of the whole page.
func (tb *tab) screenshot(t *testing.T) []byte {
	t.Helper()
	step, cancel := context.WithTimeout(tb.ctx, browserWait)
	defer cancel()
	png, err := chromedp.Run(step, chromedp.FullScreenshot(100))
	if err != nil || len(png) == 0 {
		t.Fatalf("screenshot: %v", err)
	}
	return png
}

// screenshotHTML is a PNG of an HTML document, opened without JavaScript.
func (b *browser) screenshotHTML(t *testing.T, doc string) []byte {
	t.Helper()
	path := writeFile(t, "page.html", doc)
	tb, _ := b.open(t, "file://"+path, false)
	return tb.screenshot(t)
}

// renderFirstRow draws the data of the dashboard's first row of panels (as
// Prometheus answers their queries from start to now) as Grafana lays
// them out: a title and a line per series, as SVG. Grafana itself is not
// installed here; this is its panels' data.
func renderFirstRow(t *testing.T, prom *promServer, start time.Time) string {
	t.Helper()
	d := readDashboard(t)
	var b strings.Builder
	b.WriteString(`<!doctype html><html><head><meta charset="utf-8"><style>
body{margin:0;background:#111217;color:#ccccdc;font:12px sans-serif;display:flex;gap:8px;padding:8px;width:1484px;height:290px}
.p{background:#181b1f;border:1px solid #2c3235;flex:1;padding:6px}.p h3{margin:0 0 4px;font-size:13px}
.l{display:inline-block;margin-right:8px}</style></head><body>`)
	colors := []string{"#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9"}
	end := time.Now()
	for _, p := range d.Panels {
		if p.Type == "row" {
			if p.GridPos.Y > 0 {
				break // the first row only
			}
			continue
		}
		var series []promSeries
		var labels []string
		for _, target := range p.Targets {
			res, err := prom.queryRange(t, panelExpr(target.Expr), start, end, time.Second)
			if err != nil {
				t.Fatalf("panel %q: %v", p.Title, err)
			}
			for _, s := range res {
				series = append(series, s)
				label := target.LegendFormat
				for k, v := range s.Metric {
					label = strings.ReplaceAll(label, "{{"+k+"}}", v)
				}
				labels = append(labels, label)
			}
		}
		const w, h = 340.0, 180.0
		top := 0.0
		for _, s := range series {
			for _, v := range s.Values {
				f, _ := strconv.ParseFloat(v[1].(string), 64)
				if !math.IsNaN(f) && !math.IsInf(f, 0) {
					top = max(top, f)
				}
			}
		}
		top = max(top*1.1, 1e-9)
		fmt.Fprintf(&b, `<div class="p"><h3>%s</h3><svg width="%.0f" height="%.0f">`, html.EscapeString(p.Title), w, h)
		span := end.Sub(start).Seconds()
		for i, s := range series {
			var pts []string
			for _, v := range s.Values {
				at, _ := v[0].(float64)
				f, err := strconv.ParseFloat(v[1].(string), 64)
				if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
					continue
				}
				pts = append(pts, fmt.Sprintf("%.1f,%.1f", (at-float64(start.Unix()))/span*w, h-f/top*h))
			}
			// The first series widest: series that are equal stay visible.
			fmt.Fprintf(&b, `<polyline fill="none" stroke-width="%.1f" stroke="%s" points="%s"/>`, 1.5+2*float64(len(series)-1-i), colors[i%len(colors)], strings.Join(pts, " "))
		}
		fmt.Fprintf(&b, `<text x="2" y="12" fill="#8e8e8e">%.3g</text></svg><div>`, top/1.1)
		for i, l := range labels {
			fmt.Fprintf(&b, `<span class="l" style="color:%s">■ %s</span>`, colors[i%len(colors)], html.EscapeString(l))
		}
		b.WriteString(`</div></div>`)
	}
	b.WriteString(`</body></html>`)
	return b.String()
}
