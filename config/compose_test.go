package config

import (
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// root is the repository's root, seen from this package's directory.
var root = ".."

type composeFile struct {
	Services map[string]composeService
	Volumes  map[string]any
}

type composeService struct {
	Build       yaml.Node // "." or {context, dockerfile}
	Ports       []string
	Expose      []string
	Volumes     []string
	Environment map[string]string
}

// There is no Docker engine where the tests run, so docker-compose.yml is
// checked for what breaks a fleet silently: missing files, clashing ports,
// and Prometheus scraping something that does not listen.
func TestDockerCompose(t *testing.T) {
	var compose composeFile
	readYAML(t, filepath.Join(root, "docker-compose.yml"), &compose)
	if len(compose.Services) == 0 {
		t.Fatal("docker-compose.yml has no services")
	}

	published := map[int]string{} // host port -> service
	listens := map[string][]int{} // service -> container ports
	var prometheusConfig string
	for name, s := range compose.Services {
		if s.Build.Kind != 0 {
			context, dockerfile := s.Build.Value, "Dockerfile"
			if s.Build.Kind == yaml.MappingNode {
				var b struct{ Context, Dockerfile string }
				if err := s.Build.Decode(&b); err != nil {
					t.Fatalf("%s.build: %v", name, err)
				}
				context = b.Context
				if b.Dockerfile != "" {
					dockerfile = b.Dockerfile
				}
			}
			mustExist(t, name+".build", filepath.Join(context, dockerfile))
		}
		for _, v := range s.Volumes {
			parts := strings.Split(v, ":")
			source := parts[0]
			switch {
			case len(parts) < 2:
				t.Errorf("%s.volumes: %q is not source:target", name, v)
			case strings.HasPrefix(source, ".") || strings.HasPrefix(source, "/"):
				mustExist(t, name+".volumes", source)
				if parts[1] == "/etc/prometheus/prometheus.yml" {
					prometheusConfig = source
				}
			default:
				if _, ok := compose.Volumes[source]; !ok {
					t.Errorf("%s.volumes: named volume %q is not declared under volumes", name, source)
				}
			}
		}
		for _, p := range s.Ports {
			spec, _, _ := strings.Cut(p, "/") // drop /tcp, /udp
			parts := strings.Split(spec, ":")
			container := port(t, name+".ports", parts[len(parts)-1])
			listens[name] = append(listens[name], container)
			if len(parts) == 1 {
				continue // published on a random host port
			}
			host := port(t, name+".ports", parts[len(parts)-2])
			if other, dup := published[host]; dup {
				t.Errorf("%s.ports: host port %d is published by %s too", name, host, other)
			}
			published[host] = name
		}
		for _, p := range s.Expose {
			listens[name] = append(listens[name], port(t, name+".expose", p))
		}
	}

	if prometheusConfig == "" {
		t.Fatal("no service mounts a file on /etc/prometheus/prometheus.yml")
	}
	var prom struct {
		RuleFiles     []string `yaml:"rule_files"`
		ScrapeConfigs []struct {
			StaticConfigs []struct{ Targets []string } `yaml:"static_configs"`
		} `yaml:"scrape_configs"`
	}
	readYAML(t, filepath.Join(root, prometheusConfig), &prom)
	if len(prom.RuleFiles) == 0 {
		t.Errorf("%s: no rule_files: the alerting rules of deploy/rules are not loaded", prometheusConfig)
	}
	for _, pattern := range prom.RuleFiles {
		if !mountedMatch(compose.Services, pattern) {
			t.Errorf("%s: rule_files %q matches no file mounted into a service", prometheusConfig, pattern)
		}
	}
	scraped := map[string]bool{}
	for _, sc := range prom.ScrapeConfigs {
		for _, st := range sc.StaticConfigs {
			for _, target := range st.Targets {
				host, p, err := net.SplitHostPort(target)
				if err != nil {
					t.Errorf("%s: target %q: %v", prometheusConfig, target, err)
					continue
				}
				if _, ok := compose.Services[host]; !ok {
					t.Errorf("%s: target %q names no compose service", prometheusConfig, target)
				} else if !slices.Contains(listens[host], port(t, prometheusConfig, p)) {
					t.Errorf("%s: target %q: %s listens on %v", prometheusConfig, target, host, listens[host])
				}
				scraped[host] = true
			}
		}
	}

	// Every worker serves metrics where Prometheus can reach them, and is scraped.
	workers := 0
	for name, s := range compose.Services {
		addr, ok := s.Environment["SLUICE_WORKER_METRICS_ADDR"]
		if !ok {
			continue
		}
		workers++
		host, p, err := net.SplitHostPort(addr)
		if ip := net.ParseIP(host); err != nil || host == "localhost" || ip != nil && ip.IsLoopback() {
			t.Errorf("%s: SLUICE_WORKER_METRICS_ADDR=%s is unreachable from other containers; use 0.0.0.0:2112", name, addr)
		}
		if !slices.Contains(listens[name], port(t, name, p)) {
			t.Errorf("%s: metrics port %s is not under expose or ports", name, p)
		}
		if !scraped[name] {
			t.Errorf("%s: Prometheus does not scrape it", name)
		}
	}
	if workers != 3 {
		t.Errorf("docker-compose.yml has %d workers with SLUICE_WORKER_METRICS_ADDR, want 3", workers)
	}
	checkGrafana(t, compose, listens)
}

// checkGrafana: a service provisions a Prometheus data source at a compose
// service that listens there, and a dashboard folder mounted from deploy/
// whose every panel queries that data source by its uid.
func checkGrafana(t *testing.T, compose composeFile, listens map[string][]int) {
	t.Helper()
	const datasources, dashboards = "/etc/grafana/provisioning/datasources/", "/etc/grafana/provisioning/dashboards/"
	var uid string
	var panelDirs []string
	for name, s := range compose.Services {
		for _, v := range s.Volumes {
			source, target, _ := strings.Cut(v, ":")
			target, _, _ = strings.Cut(target, ":")
			switch {
			case strings.HasPrefix(target, datasources):
				var ds struct {
					Datasources []struct{ UID, Type, URL string }
				}
				readYAML(t, filepath.Join(root, source), &ds)
				for _, d := range ds.Datasources {
					if d.Type != "prometheus" {
						continue
					}
					uid = d.UID
					host, p, err := net.SplitHostPort(strings.TrimPrefix(d.URL, "http://"))
					if err != nil || !slices.Contains(listens[host], port(t, source, p)) {
						t.Errorf("%s: data source url %q is no compose service's port (%v)", source, d.URL, listens[host])
					}
				}
			case strings.HasPrefix(target, dashboards):
				var prov struct {
					Providers []struct{ Options struct{ Path string } }
				}
				readYAML(t, filepath.Join(root, source), &prov)
				for _, p := range prov.Providers {
					dir, ok := mountSource(s, p.Options.Path)
					if !ok {
						t.Errorf("%s: dashboards path %q is not mounted into %s", source, p.Options.Path, name)
						continue
					}
					panelDirs = append(panelDirs, dir)
				}
			}
		}
	}
	if uid == "" || len(panelDirs) == 0 {
		t.Fatalf("docker-compose.yml provisions no Grafana Prometheus data source (uid %q) or no dashboards (%v)", uid, panelDirs)
	}
	for _, dir := range panelDirs {
		files, _ := filepath.Glob(filepath.Join(root, dir, "*.json"))
		if len(files) == 0 {
			t.Errorf("dashboards folder %s holds no dashboard", dir)
		}
		for _, f := range files {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			var d struct {
				Panels []struct {
					Type, Title string
					Datasource  struct{ UID string }
					Targets     []struct{ Expr string }
				}
			}
			if err := json.Unmarshal(data, &d); err != nil {
				t.Fatalf("%s: %v", f, err)
			}
			for _, p := range d.Panels {
				if p.Type == "row" {
					continue
				}
				if p.Datasource.UID != uid || len(p.Targets) == 0 {
					t.Errorf("%s: panel %q queries data source %q with %d queries, want %q and at least one", f, p.Title, p.Datasource.UID, len(p.Targets), uid)
				}
			}
		}
	}
}

// mountSource is the host path mounted into service s at target.
func mountSource(s composeService, target string) (string, bool) {
	for _, v := range s.Volumes {
		parts := strings.Split(v, ":")
		if len(parts) >= 2 && parts[1] == target {
			return parts[0], true
		}
	}
	return "", false
}

// mountedMatch reports whether a file mounted into a service has a
// container path that pattern (a glob) matches.
func mountedMatch(services map[string]composeService, pattern string) bool {
	for _, s := range services {
		for _, v := range s.Volumes {
			parts := strings.Split(v, ":")
			if ok, _ := filepath.Match(pattern, parts[min(1, len(parts)-1)]); ok && len(parts) >= 2 {
				return true
			}
		}
	}
	return false
}

func readYAML(t *testing.T, path string, v any) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(data, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

// mustExist checks that a path relative to the repository's root exists.
func mustExist(t *testing.T, key, path string) {
	t.Helper()
	if _, err := os.Stat(filepath.Join(root, path)); err != nil {
		t.Errorf("%s: %v", key, err)
	}
}

func port(t *testing.T, key, s string) int {
	t.Helper()
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 || n > 65535 {
		t.Errorf("%s: %q is not a port number from 1 to 65535", key, s)
	}
	return n
}
