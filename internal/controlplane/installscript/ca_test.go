package installscript

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/better-compute/better-compute/internal/checks/tools"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

func certPEM(t *testing.T, srv *httptest.Server) []byte {
	t.Helper()
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
}

// R11.5: --download-ca-file takes CA certificates and nothing else: a
// private key given by mistake is refused, never embedded in a script.
func TestDownloadCAPEM(t *testing.T) {
	srv := httptest.NewTLSServer(&downloads{})
	defer srv.Close()
	ca := certPEM(t, srv)
	got, err := DownloadCAPEM(append(append([]byte("\n"), ca...), ca...))
	if err != nil || strings.Count(got, "-----BEGIN CERTIFICATE-----") != 2 || strings.HasSuffix(got, "\n") {
		t.Fatalf("two certificates: %q, %v", got, err)
	}
	if got, err := DownloadCAPEM(nil); got != "" || err != nil {
		t.Fatalf("empty: %q %v", got, err)
	}
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	der, _ := x509.MarshalECPrivateKey(key)
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})
	for _, tc := range []struct {
		name string
		in   []byte
		msg  string
	}{
		{"a private key", append(append([]byte{}, ca...), keyPEM...), "holds a EC PRIVATE KEY block"},
		{"text", []byte("hello"), "want the PEM of CA certificates"},
		{"text after", append(append([]byte{}, ca...), "trailing"...), "and nothing else"},
		{"bad certificate", pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: []byte("nope")}), "does not parse"},
		{"too large", make([]byte, maxDownloadCASize+1), "larger than"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := DownloadCAPEM(tc.in)
			e, ok := errs.As(err)
			if !ok || e.Code != errs.InvalidArgument || e.Field != "--download-ca-file" || !strings.Contains(e.Message, tc.msg) {
				t.Fatalf("err = %v, want INVALID_ARGUMENT on --download-ca-file with %q", err, tc.msg)
			}
			p := validParams(t)
			p.DownloadCA = tc.in
			if _, err := Generate(p); err == nil {
				t.Fatal("Generate accepted it")
			}
		})
	}
}

// tlsSetup serves the fake bcd over TLS from a private CA, as better-compute
// dev does, and returns params whose script trusts that CA.
func tlsSetup(t *testing.T) (*downloads, *httptest.Server, Params) {
	d := &downloads{files: map[string][]byte{}}
	srv := httptest.NewTLSServer(d)
	t.Cleanup(srv.Close)
	p := validParams(t)
	p.BaseURL = srv.URL
	bin := fakeBCD("v1")
	for _, a := range Arches {
		d.files["/api/compute/downloads/bcd/0.1.0/linux-"+a] = bin
	}
	p.SHA256 = map[string]string{"amd64": sum(bin), "arm64": sum(bin)}
	p.DownloadCA = certPEM(t, srv)
	return d, srv, p
}

// R11.5: with --download-ca-file the script downloads over https from a
// control plane whose certificate a private CA signed, with curl and with
// wget; without it the same server is refused (the system's CAs do not
// know it) and nothing is installed. BCD_SYSFS_ROOT and BCD_PROCFS_ROOT
// reach bcd join only under BCD_ROOT.
func TestInstallScriptPrivateCA(t *testing.T) {
	for _, tool := range []string{"curl", "wget"} {
		t.Run(tool, func(t *testing.T) {
			bin := toolPath(t, tool)
			_, _, p := tlsSetup(t)
			r := newRun(t, p)
			sys, proc := t.TempDir(), t.TempDir()
			r.env = []string{"PATH=" + bin, "BCD_ALLOW_HTTP=0", "BCD_SYSFS_ROOT=" + sys, "BCD_PROCFS_ROOT=" + proc}
			res := r.run(newToken(t)+"\n", true)
			if res.code != 0 {
				t.Fatalf("exit %d: %s", res.code, res.stderr)
			}
			if got := readFile(t, filepath.Join(r.root, "usr/local/bin/bcd")); got != string(fakeBCD("v1")) {
				t.Fatalf("binary %q", got)
			}
			want := strings.Join([]string{"join", "--config", filepath.Join(r.root, "etc/bcd/config.toml"), "--data-dir", filepath.Join(r.root, "var/lib/bcd"),
				"--sysfs-root", sys, "--procfs-root", proc}, "\n") + "\n"
			if got := readFile(t, filepath.Join(r.log, "args")); got != want {
				t.Fatalf("bcd args %q, want %q", got, want)
			}
			// The CA file lived in the script's temporary directory only.
			for _, f := range files(t, r.root) {
				if strings.HasSuffix(f, "ca.pem") {
					t.Errorf("left behind %s", f)
				}
			}

			// The same server without the CA: TLS fails, nothing installed.
			p.DownloadCA = nil
			r = newRun(t, p)
			r.env = []string{"PATH=" + bin}
			res = r.run(newToken(t)+"\n", true)
			if res.code == 0 || !strings.Contains(res.stderr, "could not download https://127.0.0.1:") {
				t.Fatalf("without the CA: exit %d: %s", res.code, res.stderr)
			}
			r.nothingInstalled()
		})
	}
}

// toolPath returns a PATH directory with what the script needs and only one
// of curl and wget.
func toolPath(t *testing.T, downloader string) string {
	t.Helper()
	dir := t.TempDir()
	for _, tool := range []string{"id", "uname", "mktemp", "rm", "sha256sum", "cut", "mkdir", "chmod", "cp", "mv", "sed", "cat", "env", "printf", downloader} {
		p := tools.Need(t, tool, "the install script runs it")
		if err := os.Symlink(p, filepath.Join(dir, tool)); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}
