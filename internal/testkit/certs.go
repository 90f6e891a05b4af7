package testkit

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// CA is a certificate authority of a test's own, made with crypto/x509 (no
// openssl needed), whose certificates are PEM files in a temp dir: for TLS
// between a test's clients and a redis-server it starts.
type CA struct {
	CertFile string // the CA's certificate, PEM
	dir      string
	cert     *x509.Certificate
	key      *ecdsa.PrivateKey
}

// NewCA makes a CA valid for a day.
func NewCA(tb testing.TB) *CA {
	tb.Helper()
	ca := &CA{dir: tb.TempDir(), key: newKey(tb)}
	tmpl := template(tb, "sluice test CA", time.Now().Add(24*time.Hour))
	tmpl.IsCA, tmpl.BasicConstraintsValid = true, true
	tmpl.KeyUsage = x509.KeyUsageCertSign | x509.KeyUsageCRLSign
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &ca.key.PublicKey, ca.key)
	if err != nil {
		tb.Fatal(err)
	}
	if ca.cert, err = x509.ParseCertificate(der); err != nil {
		tb.Fatal(err)
	}
	ca.CertFile = ca.write(tb, "ca.pem", "CERTIFICATE", der)
	return ca
}

// Issue signs a certificate for hosts (DNS names or IP addresses; none for
// a client certificate), good for servers and clients alike until
// notAfter, and writes it and its private key to name.pem and name-key.pem.
func (ca *CA) Issue(tb testing.TB, name string, hosts []string, notAfter time.Time) (certFile, keyFile string) {
	tb.Helper()
	key := newKey(tb)
	tmpl := template(tb, name, notAfter)
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		tb.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		tb.Fatal(err)
	}
	return ca.write(tb, name+".pem", "CERTIFICATE", der), ca.write(tb, name+"-key.pem", "PRIVATE KEY", keyDER)
}

func newKey(tb testing.TB) *ecdsa.PrivateKey {
	tb.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		tb.Fatal(err)
	}
	return key
}

// template is a certificate's fields but its key usage, valid from an
// hour ago (clocks differ) to notAfter.
func template(tb testing.TB, name string, notAfter time.Time) *x509.Certificate {
	tb.Helper()
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 64))
	if err != nil {
		tb.Fatal(err)
	}
	return &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     notAfter,
	}
}

func (ca *CA) write(tb testing.TB, name, blockType string, der []byte) string {
	tb.Helper()
	path := filepath.Join(ca.dir, name)
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: blockType, Bytes: der}), 0o600); err != nil {
		tb.Fatal(err)
	}
	return path
}
