// Package fakemachine writes a fake machine: the sysfs and procfs trees
// bcd's hardware claims are read from (node/claims), with the firmware
// identifiers, NICs and GPUs it is told. `bcd fake-machine` writes one for
// an operator trying the join flows on a laptop, and `better-compute dev`
// writes one for each development bcd, so it is shared by both binaries.
// The layout written here is the one node/claims reads; its round-trip
// test writes with this package and reads with Collect, so the two agree.
package fakemachine

import (
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"

	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/fsutil"
	"github.com/better-compute/better-compute/internal/shared/hwid"
)

// The DMI files under <sysfs>/class/dmi/id that hold the product UUID and
// serials.
const (
	dmiDir           = "class/dmi/id"
	dmiProductUUID   = "product_uuid"
	dmiProductSerial = "product_serial"
	dmiBoardSerial   = "board_serial"
	dmiChassisSerial = "chassis_serial"
)

// Marker is the file Write leaves at the root of every tree it
// writes. Write replaces a tree only when it holds this file, so a
// mistyped --out (the real /sys, a home directory) is never touched.
const Marker = ".bcd-fake-machine"

// Machine is a machine for `bcd fake-machine`: what its firmware, NICs
// and GPU driver report. Values are written as given, placeholders included
// (a fake machine may well say "To Be Filled By O.E.M."), so that every
// page flow, the refused ones too, can be tried on one laptop.
type Machine struct {
	ProductUUID   string
	ProductSerial string
	BoardSerial   string
	ChassisSerial string
	// MACs are the permanent addresses of physical NICs eth0, eth1, ….
	MACs []string
	// GPUUUIDs are NVIDIA GPUs, written under the procfs root.
	GPUUUIDs []string
}

// Write writes m as the sysfs tree node/claims.Collect reads, under sysfsRoot, and
// its GPUs as the procfs tree under procfsRoot (required when m has GPUs,
// ignored otherwise):
//
//	<sysfs>/class/dmi/id/{product_uuid,product_serial,board_serial,chassis_serial}
//	<sysfs>/class/net/ethN/{address,addr_assign_type=0,device -> ../../../devices/pci0000:00/0000:00:NN.0}
//	<sysfs>/class/net/lo/{address,addr_assign_type}   (no device: not a physical NIC)
//	<procfs>/driver/nvidia/gpus/0000:NN:00.0/information   ("GPU UUID: …")
//
// A root that does not exist is created; an existing one must be empty or
// hold Marker (a tree Write wrote before, which it replaces).
// Anything else is errs.AlreadyExists. Claims that node/claims.Collect would refuse
// (a control character, a malformed MAC) are errs.InvalidArgument naming
// the flag of `bcd fake-machine`.
func Write(sysfsRoot, procfsRoot string, m Machine) error {
	macs, err := check(m)
	if err != nil {
		return err
	}
	if len(m.GPUUUIDs) > 0 && procfsRoot == "" {
		return errs.Invalid("--procfs-out", "required with --gpu-uuid: the GPUs are read from procfs (bcd join --procfs-root)")
	}
	if err := prepareRoot(sysfsRoot, "--out", []string{"class", "devices"}); err != nil {
		return err
	}
	files := map[string]string{}
	dmi := filepath.FromSlash(dmiDir)
	for name, v := range map[string]string{
		dmiProductUUID: m.ProductUUID, dmiProductSerial: m.ProductSerial,
		dmiBoardSerial: m.BoardSerial, dmiChassisSerial: m.ChassisSerial,
	} {
		files[filepath.Join(dmi, name)] = v + "\n"
	}
	links := map[string]string{}
	for i, mac := range macs {
		dev := filepath.Join("devices", "pci0000:00", fmt.Sprintf("0000:00:%02x.0", 0x10+i))
		nic := filepath.Join("class", "net", fmt.Sprintf("eth%d", i))
		files[filepath.Join(nic, "address")] = mac + "\n"
		files[filepath.Join(nic, "addr_assign_type")] = "0\n"
		files[filepath.Join(dev, "vendor")] = "0x8086\n"
		links[filepath.Join(nic, "device")] = filepath.Join("..", "..", "..", dev)
	}
	// The loopback interface, as on every Linux machine: no device, so it
	// is never claimed.
	files[filepath.Join("class", "net", "lo", "address")] = "00:00:00:00:00:00\n"
	files[filepath.Join("class", "net", "lo", "addr_assign_type")] = "0\n"
	if err := writeTree(sysfsRoot, files, links); err != nil {
		return err
	}
	if len(m.GPUUUIDs) == 0 {
		return nil
	}
	if err := prepareRoot(procfsRoot, "--procfs-out", []string{"driver"}); err != nil {
		return err
	}
	gpus := map[string]string{}
	for i, g := range m.GPUUUIDs {
		gpus[filepath.Join("driver", "nvidia", "gpus", fmt.Sprintf("0000:%02x:00.0", 0x17+i), "information")] =
			"Model: \t\t NVIDIA fake GPU\nIRQ:   \t\t 0\nGPU UUID: \t " + g + "\nVideo BIOS: \t ??.??.??.??.??\n"
	}
	return writeTree(procfsRoot, gpus, nil)
}

// check refuses what node/claims.Collect would refuse, naming the flag, and returns
// the MACs as sysfs writes them (lower case, colon separated).
func check(m Machine) ([]string, error) {
	macs := make([]string, 0, len(m.MACs))
	for _, s := range m.MACs {
		hw, err := net.ParseMAC(strings.TrimSpace(s))
		if err != nil || len(hw) != 6 {
			return nil, errs.Invalid("--mac", "%q is not a MAC like 3c:ec:ef:01:02:03", s)
		}
		macs = append(macs, hw.String())
	}
	for _, g := range m.GPUUUIDs {
		if strings.TrimSpace(g) == "" {
			return nil, errs.Invalid("--gpu-uuid", "empty")
		}
	}
	c := hwid.Claims{ProductUUID: m.ProductUUID, ProductSerial: m.ProductSerial, BoardSerial: m.BoardSerial,
		ChassisSerial: m.ChassisSerial, MACs: macs, GPUUUIDs: m.GPUUUIDs}
	if err := hwid.Validate(c); err != nil {
		var ce *hwid.ClaimError
		if !errors.As(err, &ce) {
			return nil, err
		}
		flag := map[string]string{"productUuid": "--product-uuid", "productSerial": "--serial", "boardSerial": "--board-serial",
			"chassisSerial": "--chassis-serial", "macs": "--mac", "gpuUuids": "--gpu-uuid"}[strings.SplitN(ce.Field, "[", 2)[0]]
		if flag == "" {
			flag = ce.Field
		}
		return nil, errs.Invalid(flag, "bcd join would refuse this machine's claims (%s)", ce.Reason)
	}
	// Every value becomes one line of a file.
	for flag, v := range map[string]string{"--product-uuid": m.ProductUUID, "--serial": m.ProductSerial, "--board-serial": m.BoardSerial, "--chassis-serial": m.ChassisSerial} {
		if strings.ContainsAny(v, "\r\n") {
			return nil, errs.Invalid(flag, "must be one line")
		}
	}
	return macs, nil
}

// prepareRoot makes root ready for a new tree: created when missing, cleared of
// the subtrees Write owns when it holds Marker, refused when it is
// anything else.
func prepareRoot(root, flag string, owned []string) error {
	if root == "" {
		return errs.Invalid(flag, "required")
	}
	entries, err := os.ReadDir(root)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		if err := os.MkdirAll(root, 0o755); err != nil {
			return errs.Invalid(flag, "cannot create %s: %v", root, fsutil.WithoutPath(err))
		}
	case err != nil:
		return errs.Invalid(flag, "%s: %v", root, fsutil.WithoutPath(err))
	case len(entries) > 0:
		if st, err := os.Lstat(filepath.Join(root, Marker)); err != nil || !st.Mode().IsRegular() {
			return errs.New(errs.AlreadyExists, "%s is not empty and was not written by bcd fake-machine: nothing was changed; choose a new directory for %s", root, flag)
		}
		for _, sub := range owned {
			if err := os.RemoveAll(filepath.Join(root, sub)); err != nil {
				return fmt.Errorf("clear the old fake machine: %w", err)
			}
		}
	}
	// The marker first: a tree a dying process left half written is still
	// ours to replace.
	return os.WriteFile(filepath.Join(root, Marker), []byte("written by bcd fake-machine (docs/joining.md); safe to delete\n"), 0o644)
}

// writeTree writes files (path -> content, 0444 like sysfs) and symlinks
// (path -> target) under root.
func writeTree(root string, files, links map[string]string) error {
	for p, content := range files {
		full := filepath.Join(root, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(full, []byte(content), 0o444); err != nil {
			return err
		}
	}
	for p, target := range links {
		full := filepath.Join(root, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			return err
		}
		if err := os.Symlink(target, full); err != nil {
			return err
		}
	}
	return nil
}
