package installscript

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"log"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/better-compute/better-compute/internal/checks/tools"
)

// The attack review of the install script (R15, R11.5): what someone who can
// plant a name on the machine, or answer on the network, can make it do.

// victimFile writes want (mode 0600) to a file outside the script's root for
// a planted symlink to point at, and returns a check that it is exactly as
// written.
func victimFile(t *testing.T, name, want string) (string, func()) {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(want), 0o600); err != nil {
		t.Fatal(err)
	}
	return p, func() {
		t.Helper()
		if got := readFile(t, p); got != want {
			t.Errorf("%s was written through: %q", p, got)
		}
		if m := mode(t, p); m != 0o600 {
			t.Errorf("%s: mode %o, want 0600 (chmod through a symlink)", p, m)
		}
	}
}

// plant makes root/rel a symbolic link to target.
func plant(t *testing.T, root, rel, target string) string {
	t.Helper()
	p := filepath.Join(root, rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, p); err != nil {
		t.Fatal(err)
	}
	return p
}

// R15, R11.5: every target the script writes, file or directory (config.toml,
// join-encryption.jwk, bcd.service, the binary, /etc/bcd, the bin, unit and
// data directories), is refused when it is a symbolic link, before anything
// is downloaded: the script says which and exits 1, what the link points to
// is untouched, the link stays, and nothing else appears. A target file that
// is a directory (mv would move into it) and a target directory that is a
// file are refused too.
func TestInstallScriptRefusesSymlinkedTargetsR15(t *testing.T) {
	cases := []struct {
		name    string
		rel     string // under BCD_ROOT
		dir     bool   // the link points to a directory
		dangle  bool   // the link points to nothing
		upgrade bool   // no token: the upgrade path
	}{
		{name: "config.toml", rel: "etc/bcd/config.toml"},
		{name: "config.toml on upgrade", rel: "etc/bcd/config.toml", upgrade: true},
		{name: "join-encryption.jwk", rel: "etc/bcd/join-encryption.jwk"},
		{name: "bcd.service", rel: "etc/systemd/system/bcd.service"},
		{name: "the binary", rel: "usr/local/bin/bcd"},
		{name: "/etc/bcd", rel: "etc/bcd", dir: true},
		{name: "/etc/bcd dangling", rel: "etc/bcd", dangle: true},
		{name: "the bin directory", rel: "usr/local/bin", dir: true},
		{name: "the unit directory", rel: "etc/systemd/system", dir: true},
		{name: "the data directory", rel: "var/lib/bcd", dir: true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d, _, p := setup(t)
			r := newRun(t, p)
			var target string
			check := func() {}
			switch {
			case c.dir:
				target = t.TempDir()
				check = func() {
					if f := files(t, target); len(f) != 0 {
						t.Errorf("written through the linked directory: %v", f)
					}
				}
			case c.dangle:
				target = filepath.Join(t.TempDir(), "nothing")
				check = func() {
					if _, err := os.Lstat(target); !os.IsNotExist(err) {
						t.Errorf("created %s through the dangling link: %v", target, err)
					}
				}
			default:
				// A config of this site: followed, it would make the
				// script upgrade.
				target, check = victimFile(t, filepath.Base(c.rel), "site = \""+p.Site+"\"\n")
			}
			link := plant(t, r.root, c.rel, target)
			before := files(t, r.root)

			var res runResult
			if c.upgrade {
				res = r.run("", false)
			} else {
				res = r.run(newToken(t)+"\n", true)
			}
			want := "install-bcd: refusing " + link + ": it is a symbolic link, and this script never writes through one; nothing was installed"
			if res.code != 1 || !strings.Contains(res.stderr, want) {
				t.Fatalf("exit %d, output %q; want exit 1 and %q", res.code, res.stderr, want)
			}
			check()
			if got, err := os.Readlink(link); err != nil || got != target {
				t.Errorf("the link was replaced: %q, %v", got, err)
			}
			if after := files(t, r.root); !slices.Equal(after, before) {
				t.Errorf("files under the root went from %v to %v", before, after)
			}
			if f := files(t, r.log); len(f) != 0 {
				t.Errorf("bcd ran: %v", f)
			}
			if len(d.asked) != 0 {
				t.Errorf("downloaded before refusing: %v", d.asked)
			}
		})
	}

	// Not a symbolic link, but not what the script would replace either.
	for _, c := range []struct{ name, rel, mk, want string }{
		{"config.toml a directory", "etc/bcd/config.toml", "dir", "it is not a regular file"},
		{"the binary a directory", "usr/local/bin/bcd", "dir", "it is not a regular file"},
		{"/etc/bcd a file", "etc/bcd", "file", "it is not a directory"},
	} {
		t.Run(c.name, func(t *testing.T) {
			d, _, p := setup(t)
			r := newRun(t, p)
			at := filepath.Join(r.root, c.rel)
			if c.mk == "dir" {
				os.MkdirAll(at, 0o755)
			} else {
				os.MkdirAll(filepath.Dir(at), 0o755)
				os.WriteFile(at, []byte("x\n"), 0o644)
			}
			before := files(t, r.root)
			res := r.run(newToken(t)+"\n", true)
			want := "install-bcd: refusing " + at + ": " + c.want + "; nothing was installed"
			if res.code != 1 || !strings.Contains(res.stderr, want) {
				t.Fatalf("exit %d, output %q; want exit 1 and %q", res.code, res.stderr, want)
			}
			if after := files(t, r.root); !slices.Equal(after, before) {
				t.Errorf("files under the root went from %v to %v", before, after)
			}
			if len(d.asked) != 0 {
				t.Errorf("downloaded before refusing: %v", d.asked)
			}
		})
	}
}

// plantingServer serves the builds like downloads, and runs plant once,
// before it answers the first build request.
type plantingServer struct {
	*downloads
	plant func()
	done  bool
}

func (s *plantingServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	first := !s.done
	s.done = true
	s.mu.Unlock()
	if first {
		s.plant()
	}
	s.downloads.ServeHTTP(w, r)
}

// R15, R11.5: the names the script once staged its files under are planted
// as symbolic links to files outside the root: <file>.install-bcd.tmp beside
// config.toml, join-encryption.jwk and bcd.service before the run, and
// .bcd.install-bcd.<the script's pid> beside the binary while the script
// downloads (the pid is known then). The script stages in directories of
// its own (mktemp) instead, so it installs as usual, and every planted
// link's target keeps its content and mode 0600.
func TestInstallScriptIgnoresPlantedStagingNamesR15(t *testing.T) {
	d := &downloads{files: map[string][]byte{}}
	ps := &plantingServer{downloads: d}
	srv := httptest.NewServer(ps)
	t.Cleanup(srv.Close)
	p := validParams(t)
	p.allowHTTP = true
	p.BaseURL = srv.URL
	p.BasePath = "/api/compute"
	bin := fakeBCD("v1")
	for _, a := range Arches {
		d.files["/api/compute/downloads/bcd/0.1.0/linux-"+a] = bin
	}
	p.SHA256 = map[string]string{"amd64": sum(bin), "arm64": sum(bin)}

	r := newRun(t, p)
	var checks []func()
	for _, rel := range []string{"etc/bcd/config.toml.install-bcd.tmp", "etc/bcd/join-encryption.jwk.install-bcd.tmp", "etc/systemd/system/bcd.service.install-bcd.tmp"} {
		v, check := victimFile(t, filepath.Base(rel), "victim\n")
		plant(t, r.root, rel, v)
		checks = append(checks, check)
	}
	pids := make(chan int, 1)
	r.onStart = func(pid int) { pids <- pid }
	binCheck := make(chan func(), 1)
	ps.plant = func() {
		// The script is downloading, so it has started: its pid is sent.
		pid := <-pids
		v, check := victimFile(t, "bcd", "victim\n")
		plant(t, r.root, "usr/local/bin/.bcd.install-bcd."+strconv.Itoa(pid), v)
		binCheck <- check
	}

	res := r.run(newToken(t)+"\n", true)
	if res.code != 0 {
		t.Fatalf("exit %d: %s", res.code, res.stderr)
	}
	select {
	case check := <-binCheck:
		checks = append(checks, check)
	default:
		t.Fatal("nothing planted beside the binary: was it downloaded?")
	}
	for _, check := range checks {
		check()
	}
	if got := readFile(t, filepath.Join(r.root, "usr/local/bin/bcd")); got != string(bin) {
		t.Fatalf("binary %q", got)
	}
	for _, rel := range []string{"etc/bcd/config.toml", "etc/bcd/join-encryption.jwk", "etc/systemd/system/bcd.service", "usr/local/bin/bcd"} {
		if st, err := os.Lstat(filepath.Join(r.root, rel)); err != nil || !st.Mode().IsRegular() {
			t.Errorf("%s is not a regular file the script wrote (%v)", rel, err)
		}
	}
	// Only the planted links and what the script installs: its staging
	// directories are gone.
	for _, f := range files(t, r.root) {
		if strings.Contains(f, ".install-bcd.") && !strings.HasSuffix(f, ".tmp") && !strings.Contains(f, ".bcd.install-bcd.") {
			t.Errorf("left behind %s", f)
		}
	}
}

// localhostCA returns a certificate (its own CA) and key for localhost and
// 127.0.0.1, and its PEM.
func localhostCA(t *testing.T) (tls.Certificate, []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "localhost"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
		DNSNames:              []string{"localhost"},
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}

// localhostTLS serves h over TLS as https://localhost:PORT, on every
// loopback address localhost names, and returns that URL and the CA's PEM.
// The URL names a host rather than 127.0.0.1 because Debian's BusyBox wget
// hands "IP:PORT" to openssl s_client -verify_ip, which then fails.
func localhostTLS(t *testing.T, h http.Handler) (string, []byte) {
	t.Helper()
	cert, caPEM := localhostCA(t)
	addrs, err := net.DefaultResolver.LookupHost(context.Background(), "localhost")
	if err != nil {
		t.Fatal(err)
	}
	var hosts []string
	for _, a := range addrs {
		if ip := net.ParseIP(a); ip != nil && ip.IsLoopback() && !slices.Contains(hosts, a) {
			hosts = append(hosts, a)
		}
	}
	if len(hosts) == 0 {
		t.Fatalf("localhost names no loopback address: %v", addrs)
	}
	srv := &http.Server{Handler: h, ErrorLog: log.New(io.Discard, "", 0)}
	cfg := &tls.Config{Certificates: []tls.Certificate{cert}}
	// One port on every address: the first picks it, the others may find
	// it taken, then all start over.
	for attempt := 0; ; attempt++ {
		var lns []net.Listener
		ln, err := net.Listen("tcp", net.JoinHostPort(hosts[0], "0"))
		if err != nil {
			t.Fatal(err)
		}
		lns = append(lns, ln)
		port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
		for _, h := range hosts[1:] {
			if ln, err = net.Listen("tcp", net.JoinHostPort(h, port)); err != nil {
				break
			}
			lns = append(lns, ln)
		}
		if err != nil {
			for _, ln := range lns {
				ln.Close()
			}
			if attempt == 10 {
				t.Fatalf("no port free on %v: %v", hosts, err)
			}
			continue
		}
		for _, ln := range lns {
			go srv.Serve(tls.NewListener(ln, cfg))
		}
		t.Cleanup(func() { srv.Close() })
		return "https://localhost:" + port, caPEM
	}
}

// R15, R11.5: an https download URL whose server redirects to http, to a
// build whose SHA-256 matches (so only the transport is at stake), is
// refused with curl, GNU wget and BusyBox wget: the script says so, exits 1
// and installs nothing. curl (--proto-redir =https) and GNU wget
// (--max-redirect=0) never ask the http server. BusyBox wget has no option
// to stop a redirect, so it fetches the http answer; the script sees the
// redirect in the server's responses (-S) and throws that away. With wget
// even an https redirect is refused (neither can be limited to https ones);
// curl follows that one.
func TestInstallScriptRefusesHTTPRedirectR15(t *testing.T) {
	bin := fakeBCD("v1")
	const path = "/api/compute/downloads/bcd/0.1.0/linux-"
	plain := &downloads{files: map[string][]byte{}}
	final := &downloads{files: map[string][]byte{}}
	for _, a := range Arches {
		plain.files[path+a] = bin
		final.files["/final"+path+a] = bin
	}
	plainSrv := httptest.NewServer(plain)
	t.Cleanup(plainSrv.Close)
	// Where the server redirects: the subtests set it, one at a time.
	var (
		mu   sync.Mutex
		to   string
		base string
	)
	u, caPEM := localhostTLS(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		target := plainSrv.URL
		if to == "https" {
			target = base + "/final"
		}
		mu.Unlock()
		if strings.HasPrefix(r.URL.Path, "/final/") {
			final.ServeHTTP(w, r)
			return
		}
		http.Redirect(w, r, target+r.URL.Path, http.StatusFound)
	}))
	mu.Lock()
	base = u
	mu.Unlock()
	url := base + path + runtime.GOARCH
	caFile := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(caFile, caPEM, 0o644); err != nil {
		t.Fatal(err)
	}

	type tool struct {
		name string
		path func(t *testing.T) (dir string, env []string, withCA bool)
	}
	downloaders := []tool{{"curl", func(t *testing.T) (string, []string, bool) { return toolPath(t, "curl"), nil, true }}}
	for name, argv := range wgets(t) {
		downloaders = append(downloaders, tool{name, func(t *testing.T) (string, []string, bool) {
			dir := wgetOnly(t, argv, filepath.Join(t.TempDir(), "wget-calls"))
			if name == "GNU wget" {
				return dir, nil, true
			}
			// Debian's BusyBox wget talks TLS through openssl s_client
			// (which verifies against SSL_CERT_FILE); it takes no
			// --ca-certificate.
			o := tools.Need(t, "openssl", "busybox wget's https")
			if err := os.Symlink(o, filepath.Join(dir, "openssl")); err != nil {
				t.Fatal(err)
			}
			return dir, []string{"SSL_CERT_FILE=" + caFile}, false
		}})
	}
	slices.SortFunc(downloaders, func(a, b tool) int { return strings.Compare(a.name, b.name) })

	for _, tl := range downloaders {
		for _, redirect := range []string{"http", "https"} {
			t.Run(tl.name+" to "+redirect, func(t *testing.T) {
				mu.Lock()
				to = redirect
				mu.Unlock()
				dir, env, withCA := tl.path(t)
				p := validParams(t)
				p.BaseURL = base
				p.SHA256 = map[string]string{"amd64": sum(bin), "arm64": sum(bin)}
				if withCA {
					p.DownloadCA = caPEM
				}
				r := newRun(t, p)
				r.env = append([]string{"PATH=" + dir, "BCD_ALLOW_HTTP=0"}, env...)
				plain.mu.Lock()
				plain.asked = nil
				plain.mu.Unlock()

				res := r.run(newToken(t)+"\n", true)
				if tl.name == "curl" && redirect == "https" {
					if res.code != 0 {
						t.Fatalf("curl, an https redirect: exit %d: %s", res.code, res.stderr)
					}
					if got := readFile(t, filepath.Join(r.root, "usr/local/bin/bcd")); got != string(bin) {
						t.Fatalf("binary %q", got)
					}
					return
				}
				var want string
				switch {
				case tl.name == "curl":
					want = "could not download " + url + ": curl refused to follow a redirect to a protocol other than https"
				default:
					loc := plainSrv.URL + path + runtime.GOARCH
					if redirect == "https" {
						loc = base + "/final" + path + runtime.GOARCH
					}
					want = "refusing the download: " + url + " redirects (to " + loc + "), and with wget this script follows no redirect"
				}
				if res.code != 1 || !strings.Contains(res.stderr, want) || !strings.Contains(res.stderr, "nothing was installed") {
					t.Fatalf("exit %d, output %q; want exit 1 and %q", res.code, res.stderr, want)
				}
				r.nothingInstalled()
				plain.mu.Lock()
				asked := len(plain.asked)
				plain.mu.Unlock()
				if tl.name != "busybox wget" && asked != 0 {
					t.Errorf("%s asked the http server: the redirect was followed", tl.name)
				}
				t.Logf("the http server was asked %d times", asked)
			})
		}
	}
}

// R15, R11.5: the download waits in $TMPDIR, which sudo -E keeps, so that
// may be a directory another user owns and can swap files in. A sha256sum
// that replaces the download right after its check stands in for that user:
// the script checks the copy it installs as well, refuses it, and no binary
// is installed.
func TestInstallScriptRechecksTheCopyItInstallsR15(t *testing.T) {
	_, _, p := setup(t)
	dir := toolPath(t, "curl")
	real := tools.Need(t, "sha256sum", "the script checks downloads with it")
	marker := filepath.Join(t.TempDir(), "swapped")
	wrapper := "#!/bin/sh\nout=$(" + Quote(real) + " \"$@\") || exit\nprintf '%s\\n' \"$out\"\n" +
		"if [ ! -e " + Quote(marker) + " ]; then : >" + Quote(marker) + "; printf '#!/bin/sh\\necho swapped\\n' >\"$1\"; fi\n"
	os.Remove(filepath.Join(dir, "sha256sum"))
	if err := os.WriteFile(filepath.Join(dir, "sha256sum"), []byte(wrapper), 0o755); err != nil {
		t.Fatal(err)
	}
	r := newRun(t, p)
	r.env = []string{"PATH=" + dir}
	res := r.run(newToken(t)+"\n", true)
	want := "the copy of the download to install does not match its SHA-256"
	if res.code != 1 || !strings.Contains(res.stderr, want) || !strings.Contains(res.stderr, "nothing was installed") {
		t.Fatalf("exit %d, output %q; want exit 1 and %q", res.code, res.stderr, want)
	}
	if _, err := os.Stat(marker); err != nil {
		t.Fatalf("the download was not swapped: %v", err)
	}
	for _, f := range files(t, r.root) {
		if st, err := os.Lstat(filepath.Join(r.root, f)); err == nil && !st.IsDir() {
			t.Errorf("installed %s", f)
		}
	}
	if f := files(t, r.log); len(f) != 0 {
		t.Errorf("bcd ran: %v", f)
	}
}
