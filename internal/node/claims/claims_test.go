package claims

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/hwid"
)

// tree builds files under root: path -> content. A content starting with
// "->" makes a symlink to the rest.
func tree(t *testing.T, root string, files map[string]string) {
	t.Helper()
	for p, content := range files {
		full := filepath.Join(root, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if target, ok := strings.CutPrefix(content, "->"); ok {
			if err := os.Symlink(target, full); err != nil {
				t.Fatal(err)
			}
			continue
		}
		if err := os.WriteFile(full, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// nic returns the files of a NIC under class/net/<name>.
func nic(name, addr, assign string, device bool) map[string]string {
	m := map[string]string{"class/net/" + name + "/address": addr + "\n"}
	if assign != "" {
		m["class/net/"+name+"/addr_assign_type"] = assign + "\n"
	}
	if device {
		m["class/net/"+name+"/device"] = "->../../../devices/pci0000:00/0000:00:1f.6"
	}
	return m
}

func merge(ms ...map[string]string) map[string]string {
	out := map[string]string{}
	for _, m := range ms {
		for k, v := range m {
			out[k] = v
		}
	}
	return out
}

func hostname(name string) func() (string, error) {
	return func() (string, error) { return name, nil }
}

const gpuInfo = `Model: 		 NVIDIA A100-SXM4-80GB
IRQ:   		 118
GPU UUID: 	 %s
Video BIOS: 	 92.00.36.00.10
`

func TestCollect(t *testing.T) {
	dmi := map[string]string{
		"class/dmi/id/product_uuid":   "4C4C4544-0042-3510-8051-B7C04F4E3232\n",
		"class/dmi/id/product_serial": "  SN-7701 \n",
		"class/dmi/id/board_serial":   "To Be Filled By O.E.M.\n",
		"class/dmi/id/chassis_serial": "CH-42\n",
	}
	nics := merge(
		nic("eno1", "3C:EC:EF:01:02:03", "0", true),           // physical, permanent
		nic("eno2", "3c:ec:ef:01:02:04", "", true),            // no addr_assign_type: kept
		nic("br0", "3c:ec:ef:01:02:03", "3", false),           // bridge, no device
		nic("veth1", "3c:ec:ef:aa:bb:cc", "0", false),         // virtual, no device
		nic("wlp2s0", "3c:ec:ef:09:09:09", "1", true),         // random MAC
		nic("enp5s0", "02:42:ac:11:00:02", "0", true),         // locally administered
		nic("enp6s0", "00:00:00:00:00:00", "0", true),         // zero
		nic("enp7s0", "01:00:5e:00:00:01", "0", true),         // multicast
		nic("ib0", strings.Repeat("80:", 19)+"01", "0", true), // InfiniBand: not 6 octets
		nic("lo", "00:00:00:00:00:00", "0", false),
		// Bond slaves: address is the bond's, perm_hwaddr is their own.
		nic("ens1f0", "3c:ec:ef:77:00:01", "0", true),
		nic("ens1f1", "3c:ec:ef:77:00:01", "3", true),
		map[string]string{
			"class/net/ens1f0/bonding_slave/perm_hwaddr": "3c:ec:ef:77:00:01\n",
			"class/net/ens1f1/bonding_slave/perm_hwaddr": "3c:ec:ef:77:00:02\n",
		},
	)
	gpus := map[string]string{
		"driver/nvidia/gpus/0000:07:00.0/information": strings.Replace(gpuInfo, "%s", "GPU-8f0c1d2e-aaaa-bbbb-cccc-000000000001", 1),
		"driver/nvidia/gpus/0000:0f:00.0/information": strings.Replace(gpuInfo, "%s", "GPU-8f0c1d2e-aaaa-bbbb-cccc-000000000002", 1),
	}
	wantMACs := []string{"3c:ec:ef:01:02:03", "3c:ec:ef:01:02:04", "3c:ec:ef:77:00:01", "3c:ec:ef:77:00:02"}
	wantGPUs := []string{"GPU-8f0c1d2e-aaaa-bbbb-cccc-000000000001", "GPU-8f0c1d2e-aaaa-bbbb-cccc-000000000002"}

	tests := []struct {
		name         string
		req          string
		sys, proc    map[string]string
		host         func() (string, error)
		want         hwid.Claims
		wantWarnings []string // substrings, one per expected warning
	}{
		{
			name: "full machine", req: "R4.3 R5",
			sys: merge(dmi, nics), proc: gpus, host: hostname("rack-b7-u12\n"),
			want: hwid.Claims{
				ProductUUID:   "4C4C4544-0042-3510-8051-B7C04F4E3232",
				ProductSerial: "SN-7701",
				BoardSerial:   "To Be Filled By O.E.M.", // a placeholder: hwid decides (R6)
				ChassisSerial: "CH-42",
				MACs:          wantMACs,
				GPUUUIDs:      wantGPUs,
				Hostname:      "rack-b7-u12",
			},
		},
		{
			name: "no DMI, no NVIDIA driver", req: "R4.3",
			sys: nic("eth0", "00:1b:21:12:34:56", "0", true), host: hostname("vm"),
			want:         hwid.Claims{MACs: []string{"00:1b:21:12:34:56"}, Hostname: "vm"},
			wantWarnings: []string{"no DMI information"},
		},
		{
			name: "missing DMI files and hostname error", req: "R4.3",
			sys:  map[string]string{"class/dmi/id/product_uuid": "4c4c4544-0042-3510-8051-b7c04f4e3232"},
			host: func() (string, error) { return "", errors.New("uname failed") },
			want: hwid.Claims{ProductUUID: "4c4c4544-0042-3510-8051-b7c04f4e3232"},
			wantWarnings: []string{
				"product_serial not claimed", "board_serial not claimed", "chassis_serial not claimed",
				"hostname not claimed", "no MACs claimed",
			},
		},
		{
			name: "GPU without a UUID line", req: "R4.3",
			sys:          map[string]string{"class/net/.keep": ""},
			proc:         merge(gpus, map[string]string{"driver/nvidia/gpus/0000:10:00.0/information": "Model: x\n"}),
			host:         hostname("h"),
			want:         hwid.Claims{GPUUUIDs: wantGPUs, Hostname: "h"},
			wantWarnings: []string{"no DMI information", "GPU 0000:10:00.0 not claimed"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sys, proc := t.TempDir(), t.TempDir()
			tree(t, sys, tt.sys)
			tree(t, proc, tt.proc)
			got, warnings, err := New(Config{SysfsRoot: sys, ProcfsRoot: proc, Hostname: tt.host}).Collect()
			if err != nil {
				t.Fatalf("%s: %v", tt.req, err)
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("%s: claims (-want +got):\n%s", tt.req, diff)
			}
			if len(warnings) != len(tt.wantWarnings) {
				t.Fatalf("%s: warnings %q, want %d like %q", tt.req, warnings, len(tt.wantWarnings), tt.wantWarnings)
			}
			for _, w := range tt.wantWarnings {
				if !containsSub(warnings, w) {
					t.Errorf("%s: warnings %q lack %q", tt.req, warnings, w)
				}
			}
			// What bcd collects is what hwid accepts.
			if _, err := hwid.Normalize(got); err != nil {
				t.Errorf("%s: hwid refuses the collected claims: %v", tt.req, err)
			}
		})
	}
}

func containsSub(list []string, sub string) bool {
	for _, s := range list {
		if strings.Contains(s, sub) {
			return true
		}
	}
	return false
}

// R4.3: unreadable DMI files (product_uuid is root-only on most distros)
// are warnings, not failures. CI runs as root, which
// reads a mode-0000 file, so the case that runs everywhere is a file no one
// can read as a file: a directory (EISDIR) and a socket (ENXIO) where the
// DMI file should be. The mode-0000 case runs as well when not root.
func TestCollectUnreadable(t *testing.T) {
	type unreadable struct {
		name, want string
		make       func(t *testing.T, path string)
	}
	cases := []unreadable{
		{"a directory", "is a directory", func(t *testing.T, path string) {
			if err := os.Mkdir(path, 0o755); err != nil {
				t.Fatal(err)
			}
		}},
		{"a socket", "no such device or address", func(t *testing.T, path string) {
			ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { ln.Close() })
		}},
	}
	if os.Geteuid() != 0 {
		cases = append(cases, unreadable{"mode 0000", "permission denied", func(t *testing.T, path string) {
			if err := os.WriteFile(path, []byte("x"), 0); err != nil {
				t.Fatal(err)
			}
		}})
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			// A short root: a socket path must fit in 108 bytes.
			sys, err := os.MkdirTemp("", "sys")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { os.RemoveAll(sys) })
			tree(t, sys, map[string]string{"class/dmi/id/product_serial": "SN-1"})
			c.make(t, filepath.Join(sys, "class/dmi/id/product_uuid"))
			got, warnings, err := New(Config{SysfsRoot: sys, ProcfsRoot: t.TempDir(), Hostname: hostname("h")}).Collect()
			if err != nil || got.ProductUUID != "" || got.ProductSerial != "SN-1" || !containsSub(warnings, "product_uuid not claimed") || !containsSub(warnings, c.want) {
				t.Fatalf("got %+v %q %v; want product_uuid not claimed: %s", got, warnings, err, c.want)
			}
		})
	}
}

func TestCollectErrors(t *testing.T) {
	tests := []struct {
		name, req string
		sys       func(t *testing.T) string
		code      errs.Code
		want      string
	}{
		{
			name: "sysfs root missing", req: "R11.1",
			sys:  func(t *testing.T) string { return filepath.Join(t.TempDir(), "nope") },
			code: errs.InvalidConfig, want: "sysfs_root",
		},
		{
			name: "claims hwid would refuse", req: "R4.3",
			sys: func(t *testing.T) string {
				d := t.TempDir()
				tree(t, d, map[string]string{"class/dmi/id/product_serial": "SN\x01X"})
				return d
			},
			code: errs.InvalidState, want: hwid.ReasonControlChar,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, _, err := New(Config{SysfsRoot: tt.sys(t), ProcfsRoot: t.TempDir(), Hostname: hostname("h")}).Collect()
			if errs.CodeOf(err) != tt.code || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("%s: got %v, want %s containing %q", tt.req, err, tt.code, tt.want)
			}
		})
	}
}
