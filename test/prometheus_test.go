package test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/sluicehq/sluice/internal/testkit"
)

// The deploy/ files the tests check against a real Prometheus.
const (
	rulesFile     = "../deploy/rules/sluice.yml"
	rulesTestFile = "../deploy/rules/sluice_test.yml"
	dashboardFile = "../deploy/grafana/dashboards/sluice.json"
)

// promServer is a real Prometheus scraping the test's workers every
// second as job sluice-worker (the job the rules and the dashboard name),
// evaluating deploy/rules every second.
type promServer struct{ addr string }

func startPrometheus(t *testing.T, targets []string) *promServer {
	t.Helper()
	binary, err := exec.LookPath("prometheus")
	if err != nil {
		t.Fatal("prometheus is not installed: make test installs it (scripts/test-tools.sh)")
	}
	rules, err := filepath.Abs(rulesFile)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	config := writeFile(t, "prometheus.yml", fmt.Sprintf(`
global: {scrape_interval: 1s, evaluation_interval: 1s}
rule_files: [%q]
scrape_configs:
  - job_name: sluice-worker
    static_configs: [{targets: [%s]}]
`, rules, strings.Join(targets, ", ")))
	p := &promServer{addr: testkit.FreeAddr(t)}
	log, err := os.Create(filepath.Join(dir, "prometheus.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(binary, "--config.file="+config, "--storage.tsdb.path="+filepath.Join(dir, "data"), "--web.listen-address="+p.addr)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		log.Close()
		if t.Failed() {
			b, _ := os.ReadFile(log.Name())
			t.Logf("prometheus log:\n%s", tail(string(b), 20))
		}
	})
	testkit.WaitFor(t, 30*time.Second, "prometheus ready", func() bool {
		resp, err := http.Get("http://" + p.addr + "/-/ready")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	return p
}

// promSeries is one series of a query's answer.
type promSeries struct {
	Metric map[string]string
	Value  [2]any   // an instant query's [time, "value"]
	Values [][2]any // a range query's
}

// value is an instant answer's value.
func (s promSeries) value() float64 {
	var v float64
	fmt.Sscan(s.Value[1].(string), &v)
	return v
}

// get asks Prometheus's HTTP API at path with params and decodes its data
// into v; it returns Prometheus's error, if it answered one.
func (p *promServer) get(t *testing.T, path string, params url.Values, v any) error {
	t.Helper()
	resp, err := http.Get("http://" + p.addr + path + "?" + params.Encode())
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var answer struct {
		Status, Error string
		Data          json.RawMessage
	}
	if err := json.NewDecoder(resp.Body).Decode(&answer); err != nil {
		t.Fatalf("prometheus %s: %v", path, err)
	}
	if answer.Status != "success" {
		return fmt.Errorf("%s", answer.Error)
	}
	return json.Unmarshal(answer.Data, v)
}

// query evaluates expr at instant at (now if zero).
func (p *promServer) query(t *testing.T, expr string, at time.Time) ([]promSeries, error) {
	t.Helper()
	params := url.Values{"query": {expr}}
	if !at.IsZero() {
		params.Set("time", fmt.Sprintf("%.3f", float64(at.UnixMilli())/1000))
	}
	var data struct{ Result []promSeries }
	err := p.get(t, "/api/v1/query", params, &data)
	return data.Result, err
}

// queryRange evaluates expr every step from start to end.
func (p *promServer) queryRange(t *testing.T, expr string, start, end time.Time, step time.Duration) ([]promSeries, error) {
	t.Helper()
	params := url.Values{"query": {expr}, "start": {fmt.Sprint(start.Unix())}, "end": {fmt.Sprint(end.Unix())}, "step": {fmt.Sprint(step.Seconds())}}
	var data struct{ Result []promSeries }
	err := p.get(t, "/api/v1/query_range", params, &data)
	return data.Result, err
}

// dashboard is what the tests read of the Grafana dashboard.
type dashboard struct {
	Panels []dashboardPanel
}

type dashboardPanel struct {
	Type, Title string
	GridPos     struct{ X, Y, W, H int }
	Targets     []struct{ Expr, LegendFormat string }
}

func readDashboard(t *testing.T) dashboard {
	t.Helper()
	b, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	return d
}

// panelExpr is a panel query as Grafana sends it with a 1 s scrape
// interval: $__rate_interval is four scrapes at least.
func panelExpr(expr string) string { return strings.ReplaceAll(expr, "$__rate_interval", "5s") }

// ruleFile is what the tests read of deploy/rules.
type ruleFile struct {
	Groups []struct {
		Name  string
		Rules []struct{ Record, Alert, Expr string }
	}
}

func readRules(t *testing.T) ruleFile {
	t.Helper()
	b, err := os.ReadFile(rulesFile)
	if err != nil {
		t.Fatal(err)
	}
	var f ruleFile
	if err := yaml.Unmarshal(b, &f); err != nil {
		t.Fatalf("%s: %v", rulesFile, err)
	}
	return f
}

// selectorRE finds the series a rule reads: a metric name (sluice's, a
// recorded sluice:*, or up) with its label matchers.
var selectorRE = regexp.MustCompile(`\b(sluice_[a-z_]+|sluice:[a-z0-9_:]+|up)(\{[^}]*\})?`)

// checkPanels: every query of every dashboard panel returns data now.
func checkPanels(t *testing.T, p *promServer) (empty []string) {
	t.Helper()
	for _, panel := range readDashboard(t).Panels {
		for _, target := range panel.Targets {
			res, err := p.query(t, panelExpr(target.Expr), time.Time{})
			switch {
			case err != nil:
				t.Errorf("panel %q: query %s: %v", panel.Title, target.Expr, err)
			case len(res) == 0:
				empty = append(empty, fmt.Sprintf("panel %q: %s", panel.Title, target.Expr))
			}
		}
	}
	return empty
}

// checkRules: Prometheus evaluated every rule of deploy/rules without
// error, and every series each rule reads exists. It returns what is not
// so yet.
func checkRules(t *testing.T, p *promServer) (notYet []string) {
	t.Helper()
	var data struct {
		Groups []struct {
			Name  string
			Rules []struct {
				Name, Health, LastError string
				Query                   string
			}
		}
	}
	if err := p.get(t, "/api/v1/rules", nil, &data); err != nil {
		t.Fatal(err)
	}
	loaded := 0
	for _, g := range data.Groups {
		for _, r := range g.Rules {
			loaded++
			if r.Health != "ok" || r.LastError != "" {
				notYet = append(notYet, fmt.Sprintf("rule %s: health %q %s", r.Name, r.Health, r.LastError))
			}
		}
	}
	want := 0
	for _, g := range readRules(t).Groups {
		for _, r := range g.Rules {
			want++
			for _, sel := range selectorRE.FindAllString(r.Expr, -1) {
				res, err := p.query(t, "count("+sel+")", time.Time{})
				if err != nil {
					t.Errorf("rule %s%s: count(%s): %v", r.Record, r.Alert, sel, err)
				} else if len(res) == 0 {
					notYet = append(notYet, fmt.Sprintf("rule %s%s reads %s: no series", r.Record, r.Alert, sel))
				}
			}
		}
	}
	if loaded != want {
		t.Fatalf("prometheus loaded %d rules of %s, want %d", loaded, rulesFile, want)
	}
	return notYet
}

// TestPrometheusRuleFiles: promtool accepts deploy/rules/sluice.yml and
// its unit tests pass (each alert fires on a series that should fire it and
// not on one that should not: deploy/rules/sluice_test.yml).
func TestPrometheusRuleFiles(t *testing.T) {
	t.Parallel()
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatal("promtool is not installed: make test installs it (scripts/test-tools.sh)")
	}
	for _, args := range [][]string{{"check", "rules", rulesFile}, {"test", "rules", rulesTestFile}} {
		out, err := exec.Command(promtool, args...).CombinedOutput()
		if err != nil || !strings.Contains(string(out), "SUCCESS") {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}
