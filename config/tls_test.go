package config

import (
	"context"
	"crypto/tls"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sluicehq/sluice/internal/redistest"
	"github.com/sluicehq/sluice/internal/testkit"
)

// serverName is the only name the test servers' certificates hold: a
// client that connects to 127.0.0.1 must be told it (redis.tls_server_name),
// as with managed services whose certificates name another host.
const serverName = "redis.sluice.test"

func TestLoadTLS(t *testing.T) {
	ca := testkit.NewCA(t)
	later := time.Now().Add(time.Hour)
	cert, key := ca.Issue(t, "client", nil, later)
	otherCert, _ := ca.Issue(t, "other", nil, later)
	expired, expiredKey := ca.Issue(t, "expired", nil, time.Now().Add(-time.Minute))
	dir := t.TempDir()
	notPEM := filepath.Join(dir, "not.pem")
	big := filepath.Join(dir, "big.pem")
	if err := os.WriteFile(notPEM, []byte("hello\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(big, make([]byte, maxPEMFile+1), 0o600); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(dir, "missing.pem")

	t.Run("good", func(t *testing.T) {
		f, err := Load(write(t, "redis:\n  addr: 127.0.0.1:6379\n  tls: true\n  tls_ca_file: "+ca.CertFile+
			"\n  tls_cert_file: "+cert+"\n  tls_key_file: "+key+"\n  tls_server_name: "+serverName+"\n"))
		if err != nil {
			t.Fatal(err)
		}
		c := f.Redis.TLSConfig()
		if c == nil || c.RootCAs == nil || len(c.Certificates) != 1 || c.ServerName != serverName || c.MinVersion != tls.VersionTLS12 || c.VerifyConnection != nil {
			t.Errorf("TLSConfig() = %+v; want the CA, one client certificate, server name %s, TLS 1.2 or later", c, serverName)
		}
	})
	t.Run("system roots", func(t *testing.T) {
		f, err := Load(write(t, "redis: {addr: 127.0.0.1:6379, tls: true}\n"))
		if err != nil {
			t.Fatal(err)
		}
		if c := f.Redis.TLSConfig(); c == nil || c.RootCAs != nil || len(c.Certificates) != 0 || c.ServerName != "" {
			t.Errorf("TLSConfig() = %+v; want the system's CAs, no client certificate, the server name from the address", c)
		}
	})
	t.Run("environment", func(t *testing.T) {
		t.Setenv("SLUICE_REDIS_TLS", "true")
		t.Setenv("SLUICE_REDIS_TLS_CA_FILE", ca.CertFile)
		f, err := Load(write(t, "redis: {addr: 127.0.0.1:6379}\n"))
		if err != nil {
			t.Fatal(err)
		}
		if f.Redis.TLSCaFile != ca.CertFile || f.Redis.TLSConfig().RootCAs == nil {
			t.Errorf("SLUICE_REDIS_TLS_CA_FILE gave %+v", f.Redis)
		}
	})

	for _, tt := range []struct {
		desc string
		tls  string // the redis section's TLS keys
		want []string
	}{
		{desc: "files without tls", tls: "tls_ca_file: " + ca.CertFile + ", tls_server_name: " + serverName,
			want: []string{"redis.tls_ca_file: is set, but redis.tls is false", "redis.tls_server_name: is set, but redis.tls is false"}},
		{desc: "missing CA", tls: "tls: true, tls_ca_file: " + missing,
			want: []string{"redis.tls_ca_file: cannot read it: open " + missing + ": no such file or directory"}},
		{desc: "CA not PEM", tls: "tls: true, tls_ca_file: " + notPEM,
			want: []string{"redis.tls_ca_file: " + notPEM + " holds no PEM certificate"}},
		{desc: "CA too large", tls: "tls: true, tls_ca_file: " + big,
			want: []string{"redis.tls_ca_file: " + big + " is larger than 1024 KiB"}},
		{desc: "key not a key", tls: "tls: true, tls_cert_file: " + cert + ", tls_key_file: " + cert,
			want: []string{"redis.tls_key_file: " + cert + " holds no PEM private key"}},
		{desc: "cert not a cert", tls: "tls: true, tls_cert_file: " + key + ", tls_key_file: " + key,
			want: []string{"redis.tls_cert_file: " + key + " holds no PEM certificate"}},
		{desc: "key of another certificate", tls: "tls: true, tls_cert_file: " + otherCert + ", tls_key_file: " + key,
			want: []string{"redis.tls_key_file: " + key + " is not the private key of the certificate in " + otherCert}},
		{desc: "expired certificate", tls: "tls: true, tls_cert_file: " + expired + ", tls_key_file: " + expiredKey,
			want: []string{"redis.tls_cert_file: " + expired + `: the certificate of "expired" is valid from`}},
		{desc: "key without certificate", tls: "tls: true, tls_key_file: " + key,
			want: []string{"redis.tls_cert_file: must be set with redis.tls_key_file"}},
		{desc: "certificate without key", tls: "tls: true, tls_cert_file: " + cert,
			want: []string{"redis.tls_key_file: must be set with redis.tls_cert_file"}},
		{desc: "server name with a port", tls: "tls: true, tls_server_name: 'redis.example.com:6380'",
			want: []string{`redis.tls_server_name: must be a host name (or IP address) that the server's certificate holds, like redis.example.com, without a port, got "redis.example.com:6380"`}},
	} {
		t.Run(tt.desc, func(t *testing.T) {
			_, err := Load(write(t, "redis: {addr: 127.0.0.1:6379, "+tt.tls+"}\n"))
			var p *Problems
			if !errors.As(err, &p) {
				t.Fatalf("Load: %v; want *Problems", err)
			}
			if len(p.Errs) != len(tt.want) {
				t.Fatalf("got %d problems, want %d:\n%v", len(p.Errs), len(tt.want), err)
			}
			for i, want := range tt.want {
				if !strings.Contains(p.Errs[i].Error(), want) {
					t.Errorf("problem %d = %q, want it to contain %q", i, p.Errs[i], want)
				}
			}
		})
	}

	t.Run("a refused config never connects", func(t *testing.T) {
		r := Redis{Addr: "127.0.0.1:6379", TLS: true, TLSCaFile: missing}
		c := r.TLSConfig()
		if c == nil || c.VerifyConnection == nil {
			t.Fatalf("TLSConfig() = %+v; want one whose handshakes fail", c)
		}
		if err := c.VerifyConnection(tls.ConnectionState{}); err == nil || !strings.Contains(err.Error(), "redis.tls_ca_file: cannot read it") {
			t.Errorf("its handshake fails with %v; want the problem of redis.tls_ca_file", err)
		}
	})
}

// TestPingRefused: Ping names the key to change for each way Redis, or
// the TLS handshake with it, refuses a config, against real redis-servers:
// one serving TLS only, asking for client certificates, with an ACL user
// sluice; one whose certificate has expired; one plain, with a password.
func TestPingRefused(t *testing.T) {
	ca, otherCA := testkit.NewCA(t), testkit.NewCA(t)
	later := time.Now().Add(time.Hour)
	serverCert, serverKey := ca.Issue(t, "server", []string{serverName}, later)
	clientCert, clientKey := ca.Issue(t, "client", nil, later)
	strangerCert, strangerKey := otherCA.Issue(t, "stranger", nil, later)
	good := Redis{TLS: true, TLSCaFile: ca.CertFile, TLSCertFile: clientCert, TLSKeyFile: clientKey, TLSServerName: serverName,
		Username: "sluice", Password: "right"}
	srv := redistest.StartTLSServer(t, good.TLSConfig(),
		"--tls-cert-file", serverCert, "--tls-key-file", serverKey, "--tls-ca-cert-file", ca.CertFile, "--tls-auth-clients", "yes")
	good.Addr = srv.Addr
	admin := good
	admin.Username, admin.Password = "", ""
	rdb := admin.Client()
	defer rdb.Close()
	if err := rdb.Do(context.Background(), "ACL", "SETUSER", "sluice", "on", ">right", "+ping").Err(); err != nil {
		t.Fatal(err)
	}
	expiredCert, expiredKey := ca.Issue(t, "expired", []string{serverName}, time.Now().Add(-time.Minute))
	// Its own PING cannot verify an expired certificate.
	stale := redistest.StartTLSServer(t, &tls.Config{InsecureSkipVerify: true},
		"--tls-cert-file", expiredCert, "--tls-key-file", expiredKey, "--tls-ca-cert-file", ca.CertFile, "--tls-auth-clients", "no")
	plain := redistest.StartServer(t)
	plainAdmin := Redis{Addr: plain.Addr}.Client()
	defer plainAdmin.Close()
	// Once the server has answered StartServer's PING without a password.
	if err := plainAdmin.Do(context.Background(), "CONFIG", "SET", "requirepass", "secret").Err(); err != nil {
		t.Fatal(err)
	}

	for _, tt := range []struct {
		desc    string
		change  func(r *Redis)
		wantKey string // "": Ping succeeds
		want    string
	}{
		{desc: "good", change: func(*Redis) {}},
		{desc: "another CA", change: func(r *Redis) { r.TLSCaFile = otherCA.CertFile },
			wantKey: "redis.tls_ca_file", want: "the certificate of Redis at " + srv.Addr + " is not signed by a CA in " + otherCA.CertFile},
		{desc: "system roots", change: func(r *Redis) { r.TLSCaFile = "" },
			wantKey: "redis.tls_ca_file", want: "not signed by a CA this system trusts: set redis.tls_ca_file"},
		{desc: "name not in the certificate", change: func(r *Redis) { r.TLSServerName = "" },
			wantKey: "redis.tls_server_name", want: `is for redis.sluice.test, not "127.0.0.1": set redis.tls_server_name`},
		{desc: "no client certificate", change: func(r *Redis) { r.TLSCertFile, r.TLSKeyFile = "", "" },
			wantKey: "redis.tls_cert_file", want: "wants a client certificate"},
		{desc: "client certificate of another CA", change: func(r *Redis) { r.TLSCertFile, r.TLSKeyFile = strangerCert, strangerKey },
			wantKey: "redis.tls_cert_file", want: "refused the client certificate in " + strangerCert},
		{desc: "expired server certificate", change: func(r *Redis) { r.Addr = stale.Addr },
			wantKey: "redis.tls", want: "the certificate of Redis at " + stale.Addr + " is not valid"},
		{desc: "wrong password", change: func(r *Redis) { r.Password = "wrong" },
			wantKey: "redis.password", want: `refused the login of user "sluice": the password is wrong`},
		{desc: "no password", change: func(r *Redis) { *r = Redis{Addr: plain.Addr} },
			wantKey: "redis.password", want: "Redis at " + plain.Addr + " needs a password"},
	} {
		t.Run(tt.desc, func(t *testing.T) {
			r := good
			tt.change(&r)
			c := r.Client()
			defer c.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			err := r.Ping(ctx, c)
			t.Log(err)
			var refused *RefusedError
			switch {
			case tt.wantKey == "" && err != nil:
				t.Fatalf("Ping: %v", err)
			case tt.wantKey == "":
			case !errors.As(err, &refused):
				t.Fatalf("Ping: %v; want a *RefusedError of %s", err, tt.wantKey)
			case refused.Key != tt.wantKey || !strings.Contains(err.Error(), tt.want):
				t.Errorf("Ping: %v; want %s: ...%s...", err, tt.wantKey, tt.want)
			}
		})
	}
}
