"""Shared admin behaviour."""

from django.contrib import admin


class ViewOnlyAdmin(admin.ModelAdmin):
    """Rows the relay writes itself (batches, items, files, usage events): operators
    look, they do not add or edit. `deletable` says whether the admin may delete."""

    deletable = True

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return self.deletable and super().has_delete_permission(request, obj)
