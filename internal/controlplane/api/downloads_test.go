package api_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/better-compute/better-compute/internal/controlplane/api"
	"github.com/better-compute/better-compute/internal/controlplane/store/storetest"
)

// R11.5: the API serves bcd builds from [downloads] dir as
// {basePath}/downloads/bcd/{version}/linux-{arch}, and nothing else.
func TestDownloadBCD(t *testing.T) {
	base := t.TempDir()
	dir := filepath.Join(base, "downloads")
	write := func(rel, content string) {
		p := filepath.Join(dir, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	build := "\x7fELF fake bcd amd64"
	write("bcd/0.1.0/linux-amd64", build)
	write("bcd/1.2.3-rc.1+b5/linux-arm64", "arm")
	write("bcd/0.1.0/linux-riscv64", "riscv")
	write("bcd/.hidden/linux-amd64", "hidden")
	if err := os.MkdirAll(filepath.Join(dir, "bcd/0.2.0/linux-arm64"), 0o755); err != nil {
		t.Fatal(err)
	}
	// Outside the directory, reachable only by escaping it.
	if err := os.WriteFile(filepath.Join(base, "secret"), []byte("SECRET"), 0o644); err != nil {
		t.Fatal(err)
	}
	os.MkdirAll(filepath.Join(dir, "bcd/0.3.0"), 0o755)
	if err := os.Symlink("../../../secret", filepath.Join(dir, "bcd/0.3.0/linux-amd64")); err != nil {
		t.Fatal(err)
	}

	srv, err := api.New(api.Config{DB: storetest.OpenSQLite(t), DownloadsDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(srv)
	defer hs.Close()
	get := func(method, path string) (*http.Response, string) {
		t.Helper()
		req, err := http.NewRequest(method, hs.URL+path, nil)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := hs.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, string(b)
	}

	resp, body := get("GET", "/api/compute/downloads/bcd/0.1.0/linux-amd64")
	if resp.StatusCode != 200 || body != build {
		t.Fatalf("status %d, body %q", resp.StatusCode, body)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "application/octet-stream" {
		t.Fatalf("Content-Type %q", ct)
	}
	if cl := resp.Header.Get("Content-Length"); cl != strconv.Itoa(len(build)) {
		t.Fatalf("Content-Length %q", cl)
	}
	if resp, body := get("GET", "/api/compute/downloads/bcd/1.2.3-rc.1+b5/linux-arm64"); resp.StatusCode != 200 || body != "arm" {
		t.Fatalf("semver build: %d %q", resp.StatusCode, body)
	}
	if resp, body := get("HEAD", "/api/compute/downloads/bcd/0.1.0/linux-amd64"); resp.StatusCode != 200 || body != "" || resp.Header.Get("Content-Length") != strconv.Itoa(len(build)) {
		t.Fatalf("HEAD: %d %q %v", resp.StatusCode, body, resp.Header)
	}

	for _, path := range []string{
		// traversal, plain (the mux cleans and redirects) and encoded
		"/api/compute/downloads/bcd/../../../secret",
		"/api/compute/downloads/bcd/0.1.0/../../../../secret",
		"/api/compute/downloads/bcd/..%2f..%2f..%2fsecret/linux-amd64",
		"/api/compute/downloads/bcd/..%2F..%2F/linux-amd64",
		"/api/compute/downloads/bcd/0.1.0/..%2f..%2f..%2f..%2fsecret",
		"/api/compute/downloads/bcd/../linux-amd64",
		"/api/compute/downloads/bcd/%2e%2e/linux-amd64",
		"/api/compute/downloads/bcd/0.3.0/linux-amd64", // symlink out of the directory
		// unknown arch or OS
		"/api/compute/downloads/bcd/0.1.0/linux-riscv64",
		"/api/compute/downloads/bcd/0.1.0/darwin-amd64",
		"/api/compute/downloads/bcd/0.1.0/linux-amd64.sha256",
		"/api/compute/downloads/bcd/0.1.0/amd64",
		// bad versions
		"/api/compute/downloads/bcd/.hidden/linux-amd64",
		"/api/compute/downloads/bcd/0.1.0%20/linux-amd64",
		"/api/compute/downloads/bcd/0..1/linux-amd64",
		"/api/compute/downloads/bcd/0.1.0;x/linux-amd64",
		"/api/compute/downloads/bcd/" + strings.Repeat("1", 65) + "/linux-amd64",
		// missing, directories, listings
		"/api/compute/downloads/bcd/9.9.9/linux-amd64",
		"/api/compute/downloads/bcd/0.2.0/linux-arm64",
		"/api/compute/downloads/bcd/0.1.0/",
		"/api/compute/downloads/bcd/",
		"/api/compute/downloads/",
		"/downloads/bcd/0.1.0/linux-amd64",
	} {
		resp, body := get("GET", path)
		if resp.StatusCode != 404 {
			t.Errorf("%s: status %d, want 404 (body %q)", path, resp.StatusCode, body)
		}
		if strings.Contains(body, "SECRET") || strings.Contains(body, "riscv") || strings.Contains(body, "hidden") || strings.Contains(body, "linux-amd64") {
			t.Errorf("%s: leaked %q", path, body)
		}
	}

	// Without [downloads] dir there is no route.
	srv2, err := api.New(api.Config{DB: storetest.OpenSQLite(t)})
	if err != nil {
		t.Fatal(err)
	}
	rec := httptest.NewRecorder()
	srv2.ServeHTTP(rec, httptest.NewRequest("GET", "/api/compute/downloads/bcd/0.1.0/linux-amd64", nil))
	if rec.Code != 404 {
		t.Fatalf("no downloads dir: %d", rec.Code)
	}
}
