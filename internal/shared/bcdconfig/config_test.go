package bcdconfig

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/better-compute/better-compute/internal/shared/bcdconfig/bcdconfigtest"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
)

// R11.1: the five keys docs/joining.md shows are enough; the rest defaults.
func TestParseDefaults(t *testing.T) {
	f := bcdconfigtest.New(t)
	c, err := Parse([]byte(f.TOML("")))
	if err != nil {
		t.Fatal(err)
	}
	want := &Config{
		GatewayURL:           "https://gw.eu.example.com",
		Site:                 f.Site,
		ServingCASPKIPin:     f.CAPin,
		JoinSigningKeyPin:    f.SigPin,
		JoinEncryptionKeyPin: f.EncPin,
		DataDir:              DefaultDataDir,
		SysfsRoot:            DefaultSysfsRoot,
		ProcfsRoot:           DefaultProcfsRoot,
		TPM:                  TPM{Device: DefaultTPMDevice, Mode: TPMAuto},
	}
	if diff := cmp.Diff(want, c); diff != "" {
		t.Fatalf("config (-want +got):\n%s", diff)
	}
}

func TestParse(t *testing.T) {
	f := bcdconfigtest.New(t)
	tests := []struct {
		name string
		req  string
		text string
		// wantErr lists substrings of the error; empty means success.
		wantErr []string
		check   func(t *testing.T, c *Config)
	}{
		{
			name: "all keys", req: "R11.1 R9.1",
			text: f.TOML(`gateway_server_name = "gw.eu.example.com"
data_dir = "/srv/bcd"
sysfs_root = "/host/sys"
procfs_root = "/host/proc"
[tpm]
simulator = "127.0.0.1:2321"
mode = "required"
`),
			check: func(t *testing.T, c *Config) {
				if c.GatewayServerName != "gw.eu.example.com" || c.DataDir != "/srv/bcd" ||
					c.SysfsRoot != "/host/sys" || c.ProcfsRoot != "/host/proc" ||
					c.TPM != (TPM{Simulator: "127.0.0.1:2321", Mode: TPMRequired}) {
					t.Fatalf("got %+v", c)
				}
			},
		},
		{name: "tpm off", req: "R9.1", text: f.TOML("[tpm]\nmode = \"off\"\n")},
		{name: "unknown top-level key", req: "R11.1", text: f.TOML(`gateway = "x"` + "\n"), wantErr: []string{"unknown key gateway"}},
		{name: "unknown key in tpm", req: "R11.1", text: f.TOML("[tpm]\ndevise = \"/dev/tpm0\"\n"), wantErr: []string{"unknown key tpm.devise"}},
		{name: "not toml", req: "R11.1", text: "gateway_url = \n", wantErr: []string{"not valid TOML"}},
		{name: "empty file", req: "R11.1", text: "", wantErr: []string{
			"gateway_url: required", "site: required", "serving_ca_spki_pin: required",
			"join_signing_key_pin: required", "join_encryption_key_pin: required",
		}},
		{name: "http gateway", req: "R4.3", text: strings.Replace(f.TOML(""), "https://", "http://", 1), wantErr: []string{"gateway_url: want an https URL"}},
		{name: "gateway with credentials", req: "R11.1", text: strings.Replace(f.TOML(""), "https://", "https://u:p@", 1), wantErr: []string{"gateway_url: must not carry credentials"}},
		{name: "gateway with query", req: "R11.1", text: strings.Replace(f.TOML(""), ".com\"", ".com/?x=1\"", 1), wantErr: []string{"gateway_url: must not carry a query"}},
		{name: "gateway with bad port", req: "R11.1", text: strings.Replace(f.TOML(""), ".com\"", ".com:99999\"", 1), wantErr: []string{"gateway_url"}},
		{name: "gateway with port", req: "R11.1", text: strings.Replace(f.TOML(""), ".com\"", ".com:8443\"", 1)},
		{name: "bad server name", req: "R11.3", text: f.TOML(`gateway_server_name = "https://gw"` + "\n"), wantErr: []string{"gateway_server_name:"}},
		{name: "bad site", req: "R11.1", text: strings.Replace(f.TOML(""), f.Site, "pool_x", 1), wantErr: []string{"site: want a site id"}},
		{name: "bad pin", req: "R11.1", text: strings.Replace(f.TOML(""), f.SigPin, "sha256/abc", 1), wantErr: []string{"join_signing_key_pin: want sha256/"}},
		{name: "pin without prefix", req: "R11.1", text: strings.Replace(f.TOML(""), f.CAPin, strings.TrimPrefix(f.CAPin, "sha256/"), 1), wantErr: []string{"serving_ca_spki_pin: want"}},
		{name: "relative data dir", req: "R4.1", text: f.TOML(`data_dir = "bcd"` + "\n"), wantErr: []string{"data_dir: want an absolute path"}},
		{name: "relative sysfs", req: "R4.3", text: f.TOML(`sysfs_root = "sys"` + "\n"), wantErr: []string{"sysfs_root: want an absolute path"}},
		{name: "bad tpm mode", req: "R9.1", text: f.TOML("[tpm]\nmode = \"maybe\"\n"), wantErr: []string{"tpm.mode: want auto, off or required"}},
		{name: "tpm device and simulator", req: "R9.1", text: f.TOML("[tpm]\ndevice = \"/dev/tpm0\"\nsimulator = \"localhost:2321\"\n"), wantErr: []string{"tpm: set device or simulator, not both"}},
		{name: "tpm simulator without port", req: "R9.1", text: f.TOML("[tpm]\nsimulator = \"localhost\"\n"), wantErr: []string{"tpm.simulator: want host:port"}},
		{name: "tpm relative device", req: "R9.1", text: f.TOML("[tpm]\ndevice = \"tpmrm0\"\n"), wantErr: []string{"tpm.device: want an absolute path"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Parse([]byte(tt.text))
			if len(tt.wantErr) == 0 {
				if err != nil {
					t.Fatalf("%s: %v", tt.req, err)
				}
				if tt.check != nil {
					tt.check(t, c)
				}
				return
			}
			if err == nil {
				t.Fatalf("%s: no error, want %q", tt.req, tt.wantErr)
			}
			if errs.CodeOf(err) != errs.InvalidConfig {
				t.Errorf("%s: code %s, want INVALID_CONFIG", tt.req, errs.CodeOf(err))
			}
			for _, w := range tt.wantErr {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("%s: error %q does not contain %q", tt.req, err, w)
				}
			}
		})
	}
}

// R11.1, R11.3: Write then Load round-trips, atomically and 0644.
func TestWriteLoad(t *testing.T) {
	f := bcdconfigtest.New(t)
	dir := filepath.Join(t.TempDir(), "etc", "bcd")
	path := filepath.Join(dir, "config.toml")
	c := &Config{
		GatewayURL:           "https://gw.eu.example.com",
		GatewayServerName:    "gw.eu.example.com",
		Site:                 f.Site,
		ServingCASPKIPin:     f.CAPin,
		JoinSigningKeyPin:    f.SigPin,
		JoinEncryptionKeyPin: f.EncPin,
		TPM:                  TPM{Simulator: "127.0.0.1:2321"},
	}
	if err := c.Write(path); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o644 {
		t.Errorf("mode %v, want 0644", st.Mode().Perm())
	}
	got, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	want := *c
	want.ApplyDefaults()
	if diff := cmp.Diff(&want, got); diff != "" {
		t.Fatalf("round trip (-want +got):\n%s", diff)
	}
	// Overwrite: still one file, no temporary left behind.
	got.DataDir = "/srv/bcd"
	if err := got.Write(path); err != nil {
		t.Fatal(err)
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Errorf("directory holds %d entries, want only config.toml", len(entries))
	}
	again, err := Load(path)
	if err != nil || again.DataDir != "/srv/bcd" {
		t.Fatalf("reload: %v %+v", err, again)
	}
	// An invalid config is never written.
	bad := *got
	bad.Site = ""
	if err := bad.Write(path); err == nil || !strings.Contains(err.Error(), "site: required") {
		t.Fatalf("write invalid: %v", err)
	}
	if again, err := Load(path); err != nil || again.Site != f.Site {
		t.Fatalf("the invalid write changed the file: %v", err)
	}
}

// R11.3: a missing config.toml is recognisable.
func TestLoadMissing(t *testing.T) {
	_, err := Load(filepath.Join(t.TempDir(), "config.toml"))
	if !errors.Is(err, fs.ErrNotExist) || errs.CodeOf(err) != errs.InvalidConfig {
		t.Fatalf("got %v, want INVALID_CONFIG matching fs.ErrNotExist", err)
	}
}

func TestLoadEncryptionKey(t *testing.T) {
	f := bcdconfigtest.New(t)
	other := bcdconfigtest.NewKey(t)
	goodJWK, err := pki.MarshalEncryptionJWK(&f.EncKey.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	otherJWK, _ := pki.MarshalEncryptionJWK(&other.PublicKey)
	tests := []struct {
		name      string
		req       string
		file      []byte // nil: no file
		pin       string
		wantFound bool
		wantErr   string
	}{
		{name: "matching key", req: "R11.1", file: goodJWK, pin: f.EncPin, wantFound: true},
		{name: "missing file", req: "R11.1", pin: f.EncPin},
		{name: "rotated key", req: "R11.1", file: otherJWK, pin: f.EncPin, wantFound: true,
			wantErr: "does not match join_encryption_key_pin"},
		{name: "garbage", req: "R11.1", file: []byte("{"), pin: f.EncPin, wantFound: true,
			wantErr: "not a valid JWK"},
		{name: "private key", req: "R11.1", file: []byte(`{"kty":"EC","crv":"P-256","x":"` +
			strings.Repeat("A", 43) + `","y":"` + strings.Repeat("A", 43) + `","d":"` + strings.Repeat("A", 43) + `"}`),
			pin: f.EncPin, wantFound: true, wantErr: "JWK"},
		{name: "too large", req: "R11.1", file: []byte(strings.Repeat(" ", 5000)), pin: f.EncPin, wantFound: true,
			wantErr: "larger than"},
		{name: "bad pin", req: "R11.1", file: goodJWK, pin: "sha256/x", wantErr: "join_encryption_key_pin"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			if tt.file != nil {
				if err := os.WriteFile(filepath.Join(dir, EncryptionKeyFile), tt.file, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			key, found, err := LoadEncryptionKey(dir, tt.pin)
			if found != tt.wantFound {
				t.Errorf("%s: found %v, want %v", tt.req, found, tt.wantFound)
			}
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("%s: %v", tt.req, err)
				}
				if tt.file != nil && !key.Equal(&f.EncKey.PublicKey) {
					t.Fatalf("%s: wrong key", tt.req)
				}
				if tt.file == nil && key != nil {
					t.Fatalf("%s: key without a file", tt.req)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) || errs.CodeOf(err) != errs.InvalidConfig {
				t.Fatalf("%s: error %v, want INVALID_CONFIG containing %q", tt.req, err, tt.wantErr)
			}
			if tt.file != nil && tt.pin == f.EncPin && !strings.Contains(err.Error(), "generate the install script again") {
				t.Errorf("%s: error %q does not say how to fix it", tt.req, err)
			}
		})
	}
}

// R11.3: the key written after a --server join loads back.
func TestWriteEncryptionKey(t *testing.T) {
	f := bcdconfigtest.New(t)
	dir := t.TempDir()
	if err := WriteEncryptionKey(dir, bcdconfigtest.PinOf(t, bcdconfigtest.NewKey(t)), &f.EncKey.PublicKey); err == nil {
		t.Fatal("wrote a key that does not match the pin")
	}
	if err := WriteEncryptionKey(dir, f.EncPin, &f.EncKey.PublicKey); err != nil {
		t.Fatal(err)
	}
	key, found, err := LoadEncryptionKey(dir, f.EncPin)
	if err != nil || !found || !key.Equal(&f.EncKey.PublicKey) {
		t.Fatalf("load: %v %v", found, err)
	}
}
