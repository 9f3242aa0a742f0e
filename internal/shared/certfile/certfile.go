// Package certfile serves a certificate, or a pool of CAs, from files that
// an operator may replace while the process runs (R16.1: a rotated gateway
// or agent certificate, or a CA file that gained the next serving CA, is
// used from the next TLS handshake, without a restart). The files are
// looked at at most once per Interval; a replacement that does not load (a
// pair caught half-written, a bad file) is logged and the last good one
// stays.
package certfile

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"
)

// Interval bounds how often the files are stat'ed.
const Interval = time.Second

// stamp identifies the files' current contents (size and modification
// time of each).
func stamp(paths ...string) string {
	var s string
	for _, p := range paths {
		if fi, err := os.Stat(p); err == nil {
			s += fmt.Sprintf("%s:%d:%d;", p, fi.Size(), fi.ModTime().UnixNano())
		}
	}
	return s
}

// Pair is a certificate and key loaded from two files.
type Pair struct {
	certFile, keyFile string
	check             func(*tls.Certificate) error
	log               *slog.Logger

	mu      sync.Mutex
	cert    *tls.Certificate
	stamp   string
	checked time.Time
}

// LoadPair loads certFile and keyFile; check (optional) vets a pair before
// it is used, at load and at every reload.
func LoadPair(certFile, keyFile string, check func(*tls.Certificate) error, log *slog.Logger) (*Pair, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	p := &Pair{certFile: certFile, keyFile: keyFile, check: check, log: log}
	st := stamp(certFile, keyFile)
	c, err := p.load()
	if err != nil {
		return nil, err
	}
	p.cert, p.stamp, p.checked = c, st, time.Now()
	return p, nil
}

// Fixed is a Pair that never reloads.
func Fixed(c *tls.Certificate) *Pair { return &Pair{cert: c} }

func (p *Pair) load() (*tls.Certificate, error) {
	c, err := tls.LoadX509KeyPair(p.certFile, p.keyFile)
	if err != nil {
		return nil, err
	}
	if p.check != nil {
		if err := p.check(&c); err != nil {
			return nil, err
		}
	}
	return &c, nil
}

// Get returns the pair in force, reloading it when the files changed.
func (p *Pair) Get() *tls.Certificate {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.certFile == "" || time.Since(p.checked) < Interval {
		return p.cert
	}
	p.checked = time.Now()
	st := stamp(p.certFile, p.keyFile)
	if st == p.stamp {
		return p.cert
	}
	c, err := p.load()
	if err != nil {
		p.log.Warn("certificate files changed but do not load; the previous certificate stays", "cert_file", p.certFile, "err", err)
		return p.cert
	}
	p.cert, p.stamp = c, st
	p.log.Info("certificate reloaded", "cert_file", p.certFile, "not_after", c.Leaf.NotAfter.UTC().Format(time.RFC3339))
	return p.cert
}

// Pool is a pool of CA certificates loaded from one PEM file.
type Pool struct {
	file string
	log  *slog.Logger

	mu      sync.Mutex
	pool    *x509.CertPool
	stamp   string
	checked time.Time
}

// LoadPool loads the PEM certificates of file.
func LoadPool(file string, log *slog.Logger) (*Pool, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	p := &Pool{file: file, log: log}
	st := stamp(file)
	pool, err := loadPool(file)
	if err != nil {
		return nil, err
	}
	p.pool, p.stamp, p.checked = pool, st, time.Now()
	return p, nil
}

func loadPool(file string) (*x509.CertPool, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(data) {
		return nil, errors.New("holds no PEM certificate")
	}
	return pool, nil
}

// Get returns the pool in force, reloading it when the file changed.
func (p *Pool) Get() *x509.CertPool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if time.Since(p.checked) < Interval {
		return p.pool
	}
	p.checked = time.Now()
	st := stamp(p.file)
	if st == p.stamp {
		return p.pool
	}
	pool, err := loadPool(p.file)
	if err != nil {
		p.log.Warn("CA file changed but does not load; the previous CAs stay", "file", p.file, "err", err)
		return p.pool
	}
	p.pool, p.stamp = pool, st
	p.log.Info("CA file reloaded", "file", p.file)
	return p.pool
}

// VerifyServer verifies a server's chain (leaf first) for serverName
// against pool: what tls.Config does with RootCAs, for a pool that can
// change between handshakes (use with InsecureSkipVerify and
// VerifyConnection).
func VerifyServer(cs tls.ConnectionState, pool *x509.CertPool) error {
	if len(cs.PeerCertificates) == 0 {
		return errors.New("tls: the server presented no certificate")
	}
	inter := x509.NewCertPool()
	for _, c := range cs.PeerCertificates[1:] {
		inter.AddCert(c)
	}
	_, err := cs.PeerCertificates[0].Verify(x509.VerifyOptions{DNSName: cs.ServerName, Roots: pool, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}})
	return err
}
