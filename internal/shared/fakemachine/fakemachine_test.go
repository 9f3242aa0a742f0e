package fakemachine

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/better-compute/better-compute/internal/shared/errs"
)

// A directory bcd fake-machine did not write is never touched.
func TestWriteRefusesForeignDirectory(t *testing.T) {
	dir := t.TempDir()
	precious := filepath.Join(dir, "notes.txt")
	if err := os.WriteFile(precious, []byte("keep me"), 0o644); err != nil {
		t.Fatal(err)
	}
	err := Write(dir, "", Machine{ProductSerial: "SN-1"})
	if e, ok := errs.As(err); !ok || e.Code != errs.AlreadyExists {
		t.Fatalf("err = %v, want ALREADY_EXISTS", err)
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Fatalf("the directory changed: %v", entries)
	}
	// The procfs root is checked the same way.
	sys := filepath.Join(t.TempDir(), "sys")
	err = Write(sys, dir, Machine{ProductSerial: "SN-1", GPUUUIDs: []string{"GPU-1"}})
	if e, ok := errs.As(err); !ok || e.Code != errs.AlreadyExists {
		t.Fatalf("procfs: err = %v, want ALREADY_EXISTS", err)
	}
}

// What bcd join would refuse is refused when the machine is written, naming
// the flag.
func TestWriteInvalid(t *testing.T) {
	for _, tc := range []struct {
		name string
		m    Machine
		proc string
		flag string
	}{
		{"bad MAC", Machine{ProductSerial: "S", MACs: []string{"3c:ec:ef"}}, "", "--mac"},
		{"same MAC twice", Machine{ProductSerial: "S", MACs: []string{"3c:ec:ef:01:02:03", "3C-EC-EF-01-02-03"}}, "", "--mac"},
		{"control character", Machine{ProductSerial: "S\x1b[31m"}, "", "--serial"},
		{"two lines", Machine{BoardSerial: "S\nproduct_uuid"}, "", "--board-serial"},
		{"not a UUID", Machine{ProductUUID: "not-a-uuid"}, "", "--product-uuid"},
		{"empty GPU", Machine{GPUUUIDs: []string{" "}}, "p", "--gpu-uuid"},
		{"GPU without procfs", Machine{GPUUUIDs: []string{"GPU-1"}}, "", "--procfs-out"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			proc := ""
			if tc.proc != "" {
				proc = filepath.Join(dir, tc.proc)
			}
			err := Write(filepath.Join(dir, "sys"), proc, tc.m)
			if e, ok := errs.As(err); !ok || e.Code != errs.InvalidArgument || e.Field != tc.flag {
				t.Fatalf("err = %v, want INVALID_ARGUMENT on %s", err, tc.flag)
			}
			if _, err := os.Stat(filepath.Join(dir, "sys")); err == nil {
				t.Fatal("wrote a tree for refused claims")
			}
		})
	}
}
