package claims

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/hwid"
)

// collectFake reads a fake machine back the way bcd join does.
func collectFake(t *testing.T, sys, proc string) (hwid.Claims, []string) {
	t.Helper()
	c, warnings, err := New(Config{SysfsRoot: sys, ProcfsRoot: proc, Hostname: hostname("fake-1")}).Collect()
	if err != nil {
		t.Fatalf("Collect: %v", err)
	}
	return c, warnings
}

// R4.3: a fake machine is read back exactly as written: bcd join claims
// what `bcd fake-machine` was told, in sysfs's own forms.
func TestWriteFakeRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		name string
		m    FakeMachine
		want hwid.Claims
	}{
		{"serial and uuid, one NIC",
			FakeMachine{ProductUUID: "4c4c4544-0042-3510-8053-b7c04f5a3132", ProductSerial: "SN-7701", MACs: []string{"3C-EC-EF-01-02-03"}},
			hwid.Claims{ProductUUID: "4c4c4544-0042-3510-8053-b7c04f5a3132", ProductSerial: "SN-7701", MACs: []string{"3c:ec:ef:01:02:03"}, Hostname: "fake-1"}},
		{"every identifier, two NICs and two GPUs",
			FakeMachine{ProductUUID: "4C4C4544-0042-3510-8053-B7C04F5A3132", ProductSerial: "SN-7701", BoardSerial: "BRD-1", ChassisSerial: "CH-1",
				MACs: []string{"3c:ec:ef:01:02:04", "3c:ec:ef:01:02:03"}, GPUUUIDs: []string{"GPU-8f0c1d2e-aaaa-bbbb-cccc-ddddeeeeffff", "GPU-11111111-2222-3333-4444-555555555555"}},
			hwid.Claims{ProductUUID: "4C4C4544-0042-3510-8053-B7C04F5A3132", ProductSerial: "SN-7701", BoardSerial: "BRD-1", ChassisSerial: "CH-1",
				MACs: []string{"3c:ec:ef:01:02:03", "3c:ec:ef:01:02:04"}, GPUUUIDs: []string{"GPU-11111111-2222-3333-4444-555555555555", "GPU-8f0c1d2e-aaaa-bbbb-cccc-ddddeeeeffff"}, Hostname: "fake-1"}},
		// R6.1: placeholders are written as firmware reports them; hwid
		// drops them, not the fake machine.
		{"placeholder firmware",
			FakeMachine{ProductUUID: "03000200-0400-0500-0006-000700080009", ProductSerial: "To Be Filled By O.E.M.", BoardSerial: "Default string", MACs: []string{"3c:ec:ef:01:02:03"}},
			hwid.Claims{ProductUUID: "03000200-0400-0500-0006-000700080009", ProductSerial: "To Be Filled By O.E.M.", BoardSerial: "Default string", MACs: []string{"3c:ec:ef:01:02:03"}, Hostname: "fake-1"}},
		// A locally administered MAC is written, and not claimed: claims
		// reads it as it reads a real one.
		{"a locally administered MAC is not claimed",
			FakeMachine{ProductUUID: "4c4c4544-0042-3510-8053-b7c04f5a3132", ProductSerial: "SN-1", MACs: []string{"02:42:ac:11:00:02"}},
			hwid.Claims{ProductUUID: "4c4c4544-0042-3510-8053-b7c04f5a3132", ProductSerial: "SN-1", Hostname: "fake-1"}},
		{"no NIC", FakeMachine{ProductSerial: "SN-2"}, hwid.Claims{ProductSerial: "SN-2", Hostname: "fake-1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			sys, proc := filepath.Join(dir, "sys"), filepath.Join(dir, "proc")
			if err := WriteFake(sys, proc, tc.m); err != nil {
				t.Fatal(err)
			}
			got, warnings := collectFake(t, sys, proc)
			if diff := cmp.Diff(tc.want, got, cmp.Comparer(func(a, b []string) bool { return cmp.Equal(nilIfEmpty(a), nilIfEmpty(b)) })); diff != "" {
				t.Errorf("claims (-want +got):\n%s", diff)
			}
			if len(warnings) != 0 {
				t.Errorf("warnings: %q", warnings)
			}
			if _, err := os.Stat(filepath.Join(sys, FakeMarker)); err != nil {
				t.Errorf("no marker: %v", err)
			}
		})
	}
}

func nilIfEmpty(s []string) []string {
	if len(s) == 0 {
		return nil
	}
	return s
}

// R6.3: writing again over a fake machine replaces it: a swapped NIC is
// the only NIC left, and the GPU tree follows.
func TestWriteFakeReplaces(t *testing.T) {
	dir := t.TempDir()
	sys, proc := filepath.Join(dir, "sys"), filepath.Join(dir, "proc")
	m := FakeMachine{ProductUUID: "4c4c4544-0042-3510-8053-b7c04f5a3132", ProductSerial: "SN-7701",
		MACs: []string{"3c:ec:ef:01:02:03", "3c:ec:ef:01:02:04"}, GPUUUIDs: []string{"GPU-aaaa"}}
	if err := WriteFake(sys, proc, m); err != nil {
		t.Fatal(err)
	}
	m.MACs, m.GPUUUIDs = []string{"3c:ec:ef:09:09:09"}, []string{"GPU-bbbb"}
	if err := WriteFake(sys, proc, m); err != nil {
		t.Fatal(err)
	}
	got, _ := collectFake(t, sys, proc)
	if !cmp.Equal(got.MACs, []string{"3c:ec:ef:09:09:09"}) || !cmp.Equal(got.GPUUUIDs, []string{"GPU-bbbb"}) {
		t.Fatalf("after the swap: %+v", got)
	}
}

// A directory bcd fake-machine did not write is never touched.
func TestWriteFakeRefusesForeignDirectory(t *testing.T) {
	dir := t.TempDir()
	precious := filepath.Join(dir, "notes.txt")
	if err := os.WriteFile(precious, []byte("keep me"), 0o644); err != nil {
		t.Fatal(err)
	}
	err := WriteFake(dir, "", FakeMachine{ProductSerial: "SN-1"})
	if e, ok := errs.As(err); !ok || e.Code != errs.AlreadyExists {
		t.Fatalf("err = %v, want ALREADY_EXISTS", err)
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Fatalf("the directory changed: %v", entries)
	}
	// The procfs root is checked the same way.
	sys := filepath.Join(t.TempDir(), "sys")
	err = WriteFake(sys, dir, FakeMachine{ProductSerial: "SN-1", GPUUUIDs: []string{"GPU-1"}})
	if e, ok := errs.As(err); !ok || e.Code != errs.AlreadyExists {
		t.Fatalf("procfs: err = %v, want ALREADY_EXISTS", err)
	}
}

// What bcd join would refuse is refused when the machine is written, naming
// the flag.
func TestWriteFakeInvalid(t *testing.T) {
	for _, tc := range []struct {
		name string
		m    FakeMachine
		proc string
		flag string
	}{
		{"bad MAC", FakeMachine{ProductSerial: "S", MACs: []string{"3c:ec:ef"}}, "", "--mac"},
		{"same MAC twice", FakeMachine{ProductSerial: "S", MACs: []string{"3c:ec:ef:01:02:03", "3C-EC-EF-01-02-03"}}, "", "--mac"},
		{"control character", FakeMachine{ProductSerial: "S\x1b[31m"}, "", "--serial"},
		{"two lines", FakeMachine{BoardSerial: "S\nproduct_uuid"}, "", "--board-serial"},
		{"not a UUID", FakeMachine{ProductUUID: "not-a-uuid"}, "", "--product-uuid"},
		{"empty GPU", FakeMachine{GPUUUIDs: []string{" "}}, "p", "--gpu-uuid"},
		{"GPU without procfs", FakeMachine{GPUUUIDs: []string{"GPU-1"}}, "", "--procfs-out"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			proc := ""
			if tc.proc != "" {
				proc = filepath.Join(dir, tc.proc)
			}
			err := WriteFake(filepath.Join(dir, "sys"), proc, tc.m)
			if e, ok := errs.As(err); !ok || e.Code != errs.InvalidArgument || e.Field != tc.flag {
				t.Fatalf("err = %v, want INVALID_ARGUMENT on %s", err, tc.flag)
			}
			if _, err := os.Stat(filepath.Join(dir, "sys")); err == nil {
				t.Fatal("wrote a tree for refused claims")
			}
		})
	}
}
